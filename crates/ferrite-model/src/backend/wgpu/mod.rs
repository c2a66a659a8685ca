//! The wgpu backend (cargo feature `wgpu`): WGSL compute kernels on any GPU wgpu reaches —
//! Metal on macOS, Vulkan on Linux and Windows. Weights are f16, activations and the
//! residual stream f32, K/V f16 (or f32) in pages. A step records every op into one command
//! buffer, submitted once, with one wait: for its logits.

pub mod attention;
pub mod device;
pub mod inputs;
pub mod kernels;
pub mod linear;
pub mod start;
mod step;
pub mod tensors;

use super::{
    AttentionSpec, Backend, Epilogue, Forward, GdnParams, GdnSpec, LinearIn, MoeBytes, MoeMatrices,
    MoeSpec, Pointwise, QkvPrep, Rounding, Stack, Step,
};
use crate::config::RopeStyle;
use crate::kv_dtype::KvCacheDtype;
use crate::rope::{RopeSpec, RopeTable};
use crate::settings::{DeviceKind, GpuApi};
use crate::step::{DeviceDraws, PackedStep};
use anyhow::{bail, Result};
use attention::{KvPages, QkvArgs, StepView};
use candle_core::quantized::QTensor;
use device::Gpu;
use inputs::StepInputs;
use kernels::{groups_for, launch, Kernels};
use linear::{matmul, Linear, Out, Pick};
use std::sync::Arc;
use tensors::{upload_f32, upload_words, Act, Vector};

/// The embedding table as f16 rows: the whole vocabulary, or a rank's rows from `first` on.
pub struct Embedding {
    table: Linear,
    first: usize,
}

/// Rotary tables: cos then sin, `[max_positions, half]` each.
pub struct Rope {
    table: wgpu::Buffer,
    half: usize,
    sin_at: usize,
    neox: bool,
}

/// What this backend does not run yet, named in its refusals.
const NOT_YET: &str = "not on the wgpu backend yet; use --device cpu or cuda";

pub struct WgpuBackend {
    gpu: Arc<Gpu>,
    kernels: Arc<Kernels>,
    /// The step being recorded.
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    /// Scratch activations, reused across steps.
    normed: Act,
    proj: Act,
    /// The last step's logits (or hidden rows) on the device, then on the host.
    out: Act,
    host_logits: Vec<f32>,
    /// Which matmul kernels serve which row counts.
    pub pick: Pick,
}

impl WgpuBackend {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        let kernels = Arc::new(Kernels::new(&gpu.device)?);
        gpu.take_error()?;
        Ok(Self::with_kernels(gpu, kernels))
    }

    /// A second backend on the same device and kernels (a draft model).
    pub fn beside(&self) -> Self {
        Self {
            pick: self.pick,
            ..Self::with_kernels(self.gpu.clone(), self.kernels.clone())
        }
    }

    fn with_kernels(gpu: Arc<Gpu>, kernels: Arc<Kernels>) -> Self {
        Self {
            kernels,
            encoder: None,
            pass: None,
            normed: Act::default(),
            proj: Act::default(),
            out: Act::default(),
            host_logits: Vec::new(),
            pick: match gpu.info.device_type {
                wgpu::DeviceType::Cpu => Pick::Cpu,
                _ => Pick::Gpu,
            },
            gpu,
        }
    }

    /// Opens `--device`'s adapter.
    pub fn open(api: GpuApi, index: usize) -> Result<Self> {
        Self::new(Gpu::open(api, index)?)
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The compute pass of the step being recorded (opened by the first op).
    fn pass(&mut self) -> &mut wgpu::ComputePass<'static> {
        let encoder = self.encoder.get_or_insert_with(|| {
            self.gpu
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("step"),
                })
        });
        self.pass.get_or_insert_with(|| {
            encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("step"),
                    timestamp_writes: None,
                })
                .forget_lifetime()
        })
    }

    /// `y = rms_norm(x[rows]) * w` (or a copy with `norm` None), stored or added into `y`.
    #[allow(clippy::too_many_arguments)]
    fn norm_rows(
        &mut self,
        x: &wgpu::Buffer,
        rows: usize,
        cols: usize,
        norm: Option<(&wgpu::Buffer, f32)>,
        gather: Option<(&wgpu::Buffer, u32)>,
        y: &wgpu::Buffer,
        add: bool,
    ) {
        let (gpu, k) = (self.gpu.clone(), self.kernels.clone());
        let (w, eps) = norm.unwrap_or((&k.empty, 0.0));
        let (idx, at) = gather.unwrap_or((&k.empty, u32::MAX));
        let params = [
            cols as u32,
            eps.to_bits(),
            at,
            add as u32,
            norm.is_some() as u32,
        ];
        let groups = [rows as u32, 1, 1];
        launch(
            &gpu.device,
            self.pass(),
            &k.rms_norm,
            &[x, w, idx, y],
            &params,
            groups,
        );
    }

    /// An element-wise kernel over `n` elements of `y`.
    fn pointwise(&mut self, k: &kernels::Kernel, a: &wgpu::Buffer, y: &wgpu::Buffer, p: [u32; 4]) {
        let gpu = self.gpu.clone();
        launch(
            &gpu.device,
            self.pass(),
            k,
            &[a, y],
            &p,
            groups_for(p[0] as usize),
        );
    }

    /// `input` through `w` into `y` (`[rows, w.rows]`), stored or added.
    fn project(&mut self, input: &LinearIn<Self>, w: &Linear, y: YOut) -> Result<usize> {
        let (gpu, k) = (self.gpu.clone(), self.kernels.clone());
        let (x, rows) = match input {
            LinearIn::Plain(x) => (x.buf()?.clone(), x.rows),
            LinearIn::RmsNorm { x, norm, eps } => {
                let (rows, cols) = (x.rows, x.cols);
                let normed = std::mem::take(&mut self.normed);
                let mut normed = normed;
                let nb = normed.shape(&gpu, rows, cols)?.clone();
                self.normed = normed;
                self.norm_rows(
                    x.buf()?,
                    rows,
                    cols,
                    Some((&norm.buf, *eps)),
                    None,
                    &nb,
                    false,
                );
                (nb, rows)
            }
        };
        if x_cols(input) != w.cols {
            bail!(
                "a matrix of {} columns for rows of {}",
                w.cols,
                x_cols(input)
            );
        }
        let (y, add) = match y {
            YOut::Store(act) => (act.shape(&gpu, rows, w.rows)?.clone(), false),
            YOut::Add(act) => {
                if act.rows != rows || act.cols != w.rows {
                    bail!(
                        "adding {rows} x {} into {} x {}",
                        w.rows,
                        act.rows,
                        act.cols
                    );
                }
                (act.buf()?.clone(), true)
            }
        };
        let out = Out {
            y: &y,
            ldy: w.rows,
            add,
        };
        let pick = self.pick;
        matmul(&gpu, &k, self.pass(), (&x, rows), w, out, pick);
        Ok(rows)
    }
}

impl WgpuBackend {
    /// The final norm of the logits rows into `sel`, then the LM head into `out`.
    #[allow(clippy::too_many_arguments)]
    fn select_logits(
        &mut self,
        s: &Step<Self>,
        x: &Act,
        norm: &Vector,
        eps: f32,
        head: &Linear,
        sel: &mut Act,
        out: &mut Act,
    ) -> Result<()> {
        let rows = s.host.logits_indices.len();
        let sb = sel.shape(&self.gpu, rows, x.cols)?.clone();
        let gather = Some((&s.inputs.buf, s.inputs.rows));
        self.norm_rows(
            x.buf()?,
            rows,
            x.cols,
            Some((&norm.buf, eps)),
            gather,
            &sb,
            false,
        );
        self.project(&LinearIn::Plain(sel), head, YOut::Store(out))?;
        Ok(())
    }

    /// Rows of `e` for `tokens` ids (at word `params[1]` of `ids`) into `out`, one launch per
    /// part of the table: each writes the rows whose ids it holds.
    fn embed_rows(
        &mut self,
        e: &Embedding,
        ids: &wgpu::Buffer,
        tokens: usize,
        mut params: [u32; 6],
        out: &mut Act,
        add: bool,
    ) -> Result<()> {
        let (gpu, k) = (self.gpu.clone(), self.kernels.clone());
        let y = match add {
            true => out.buf()?.clone(),
            false => out.shape(&gpu, tokens, e.table.cols)?.clone(),
        };
        for part in &e.table.parts {
            params[2] = (e.first + part.first) as u32;
            params[3] = part.rows as u32;
            let buffers = [ids, &part.buf, &y];
            launch(
                &gpu.device,
                self.pass(),
                &k.embed,
                &buffers,
                &params,
                [tokens as u32, 1, 1],
            );
        }
        Ok(())
    }
}

fn x_cols(input: &LinearIn<WgpuBackend>) -> usize {
    match input {
        LinearIn::Plain(x) => x.cols,
        LinearIn::RmsNorm { x, .. } => x.cols,
    }
}

/// Where [`WgpuBackend::project`] writes.
enum YOut<'a> {
    Store(&'a mut Act),
    Add(&'a Act),
}

impl Backend for WgpuBackend {
    type Act = Act;
    type Vector = Vector;
    type Linear = Linear;
    type Embedding = Embedding;
    type Rope = Rope;
    type LayerCache = KvPages;
    /// Refused at load: mixtures of experts are not written yet.
    type Moe = ();
    /// Refused at load: gated delta-nets are not written yet.
    type StateCache = ();
    type StepInputs = StepInputs;

    fn vector(&self, v: Vec<f32>) -> Result<Vector> {
        Ok(Vector {
            buf: upload_f32(&self.gpu, "vector", &v),
            len: v.len(),
        })
    }

    /// `[gate; up]` stacked by rows, as the gated kernel reads them; activations are f32
    /// whatever `_input` asks.
    fn linear(&self, parts: Vec<QTensor>, _stack: Stack, _input: Rounding) -> Result<Linear> {
        Linear::upload(&self.gpu, &parts)
    }

    fn embedding(&self, table: QTensor) -> Result<Embedding> {
        self.vocab_embedding(table, 0)
    }

    fn vocab_embedding(&self, table: QTensor, first: usize) -> Result<Embedding> {
        if first != 0 {
            bail!("{}: no tensor parallelism", self.describe());
        }
        Ok(Embedding {
            table: Linear::upload(&self.gpu, &[table])?,
            first,
        })
    }

    fn rope(&self, spec: &RopeSpec, max_positions: usize) -> Result<Rope> {
        let t = RopeTable::new(spec, max_positions);
        let (cos, sin) = t.tables();
        let table = [cos, sin].concat();
        Ok(Rope {
            table: upload_f32(&self.gpu, "rotary tables", &table),
            half: cos.len() / max_positions.max(1),
            sin_at: cos.len(),
            neox: spec.style == RopeStyle::Neox,
        })
    }

    fn moe(&self, _m: MoeMatrices, _spec: MoeSpec) -> Result<()> {
        bail!("mixtures of experts: {NOT_YET}")
    }

    fn random_moe(&self, _: MoeSpec, _: usize, _: Option<usize>, _: usize) -> Result<()> {
        bail!("mixtures of experts: {NOT_YET}")
    }

    fn linear_bytes(&self, w: &Linear) -> usize {
        w.bytes()
    }

    fn embedding_bytes(&self, e: &Embedding) -> usize {
        e.table.bytes()
    }

    fn moe_bytes(&self, _m: &()) -> MoeBytes {
        MoeBytes::default()
    }

    fn layer_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: KvCacheDtype,
    ) -> Result<KvPages> {
        let dtype = dtype.resolve(DeviceKind::Wgpu(GpuApi::Native, 0).auto_kv_dtype());
        KvPages::zeros(&self.gpu, num_blocks, block_size, kv_heads, head_dim, dtype)
    }

    fn state_cache(&self, _slots: usize, _spec: &GdnSpec) -> Result<()> {
        bail!("gated delta-net (linear attention) layers: {NOT_YET}")
    }

    fn step(
        &mut self,
        host: &PackedStep,
        draws: Option<DeviceDraws>,
        forward: Forward<Self>,
    ) -> Result<()> {
        if draws.is_some() {
            bail!("the wgpu backend samples on the host");
        }
        self.run_step(host, forward)
    }

    fn embed(
        &mut self,
        s: &Step<Self>,
        e: &Embedding,
        scale: Option<f32>,
        out: &mut Act,
    ) -> Result<()> {
        check_ids(&s.host.input_ids, e)?;
        let params = embed_params(e, s.inputs.ids, scale.unwrap_or(1.0), false);
        let tokens = s.host.input_ids.len();
        self.embed_rows(e, &s.inputs.buf, tokens, params, out, false)
    }

    fn add_rows(&mut self, table: &Embedding, ids: &[u32], x: &mut Act) -> Result<()> {
        if x.cols != table.table.cols || ids.len() != x.rows {
            bail!(
                "{} rows of {} for {} rows of {}",
                ids.len(),
                table.table.cols,
                x.rows,
                x.cols
            );
        }
        check_ids(ids, table)?;
        let buf = upload_words(&self.gpu, "ids", ids);
        let params = embed_params(table, 0, 1.0, true);
        self.embed_rows(table, &buf, ids.len(), params, x, true)
    }

    fn add_bias(&mut self, x: &mut Act, bias: &Vector, then: Option<Pointwise>) -> Result<()> {
        if x.cols != bias.len {
            bail!("a bias of {} for rows of {}", bias.len, x.cols);
        }
        let op = match then {
            None => 0,
            Some(Pointwise::Gelu) => 1,
            Some(Pointwise::Tanh) => 2,
        };
        let k = self.kernels.clone();
        let p = [x.len() as u32, x.cols as u32, op, 0];
        self.pointwise(&k.add_bias, &bias.buf, x.buf()?, p);
        Ok(())
    }

    fn layer_norm(&mut self, x: &mut Act, w: &Vector, b: &Vector, eps: f32) -> Result<()> {
        if x.cols != w.len || w.len != b.len {
            bail!("a LayerNorm of {} for rows of {}", w.len, x.cols);
        }
        let (gpu, k) = (self.gpu.clone(), self.kernels.clone());
        let params = [x.cols as u32, eps.to_bits()];
        let buffers = [&w.buf, &b.buf, x.buf()?];
        launch(
            &gpu.device,
            self.pass(),
            &k.layer_norm,
            &buffers,
            &params,
            [x.rows as u32, 1, 1],
        );
        Ok(())
    }

    fn matmul(&mut self, input: LinearIn<Self>, w: &Linear, out: Epilogue<Self>) -> Result<()> {
        match out {
            Epilogue::Store(y) | Epilogue::StoreResidual(y) => {
                self.project(&input, w, YOut::Store(y))?;
            }
            Epilogue::AddInto(residual) => {
                self.project(&input, w, YOut::Add(residual))?;
            }
            Epilogue::AddNormedInto {
                residual,
                norm,
                eps,
            } => {
                let mut proj = std::mem::take(&mut self.proj);
                let r = self.project(&input, w, YOut::Store(&mut proj));
                self.proj = proj;
                let rows = r?;
                let proj = self.proj.buf()?.clone();
                if residual.rows != rows || residual.cols != w.rows {
                    bail!(
                        "adding {rows} x {} into {} x {}",
                        w.rows,
                        residual.rows,
                        residual.cols
                    );
                }
                let y = residual.buf()?.clone();
                self.norm_rows(&proj, rows, w.rows, Some((&norm.buf, eps)), None, &y, true);
            }
            Epilogue::Gated(out, act) => {
                let mut proj = std::mem::take(&mut self.proj);
                let r = self.project(&input, w, YOut::Store(&mut proj));
                self.proj = proj;
                let rows = r?;
                let proj = self.proj.buf()?.clone();
                let inter = w.rows / 2;
                let y = out.shape(&self.gpu, rows, inter)?.clone();
                let op = match act {
                    super::Activation::Silu => 0,
                    super::Activation::GeluTanh => 1,
                };
                let k = self.kernels.clone();
                self.pointwise(
                    &k.gated,
                    &proj,
                    &y,
                    [(rows * inter) as u32, inter as u32, op, 0],
                );
            }
        }
        Ok(())
    }

    fn mixture(&mut self, _x: &mut Act, _n: &Vector, _eps: f32, _m: &()) -> Result<()> {
        bail!("mixtures of experts: {NOT_YET}")
    }

    fn prepare_qkv(
        &mut self,
        s: &Step<Self>,
        qkv: &Act,
        p: &QkvPrep<Self>,
        a: &AttentionSpec,
        cache: &mut KvPages,
        q: &mut Act,
    ) -> Result<()> {
        let d = a.head_dim;
        let (q_w, kv_w) = (a.num_heads * d, a.num_kv_heads * d);
        if qkv.cols != q_w + 2 * kv_w {
            bail!(
                "QKV projection is {} wide, expected {}",
                qkv.cols,
                q_w + 2 * kv_w
            );
        }
        let (gpu, k) = (self.gpu.clone(), self.kernels.clone());
        let qb = q.shape(&gpu, qkv.rows, q_w)?.clone();
        let args = QkvArgs {
            qkv: qkv.buf()?,
            bias: p.bias.map(|b| &b.buf),
            q_norm: p.q_norm.map(|n| &n.buf),
            k_norm: p.k_norm.map(|n| &n.buf),
            eps: p.eps,
            rope: p.rope.map(|r| (&r.table, r.half, r.sin_at, r.neox)),
            step: &s.inputs.buf,
            positions: s.inputs.positions,
            slots: s.inputs.groups[a.kv_group].slots,
            tokens: qkv.rows,
        };
        attention::prepare_qkv(&gpu, &k, self.pass(), &args, a, cache, &qb);
        Ok(())
    }

    fn attention(
        &mut self,
        s: &Step<Self>,
        q: &Act,
        cache: &KvPages,
        a: &AttentionSpec,
        sinks: Option<&Vector>,
        out: &mut Act,
    ) -> Result<()> {
        let (gpu, k) = (self.gpu.clone(), self.kernels.clone());
        let group = &s.inputs.groups[a.kv_group];
        let view = StepView {
            step: &s.inputs.buf,
            cu_seqlens_q: s.inputs.cu_seqlens_q,
            seq_lens_k: s.inputs.seq_lens_k,
            tables: group.tables,
            max_blocks: group.max_blocks,
            seqs: s.inputs.num_seqs,
            tokens: q.rows,
        };
        let y = out.shape(&gpu, q.rows, a.num_heads * a.head_dim)?.clone();
        let sinks = sinks.map(|v| &v.buf);
        attention::attention(&gpu, &k, self.pass(), &view, q.buf()?, cache, a, sinks, &y);
        Ok(())
    }

    fn gated_delta(
        &mut self,
        _s: &Step<Self>,
        _proj: &Act,
        _p: &GdnParams<Self>,
        _spec: &GdnSpec,
        _state: &mut (),
        _out: &mut Act,
    ) -> Result<()> {
        bail!("gated delta-net (linear attention) layers: {NOT_YET}")
    }

    fn rms_norm_rows(
        &mut self,
        x: &Act,
        rows: &[u32],
        norm: &Vector,
        eps: f32,
        out: &mut Act,
    ) -> Result<()> {
        let (n, cols) = (x.rows, x.cols);
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= n) {
            bail!("row {r} of {n}");
        }
        let count = if rows.is_empty() { n } else { rows.len() };
        let y = out.shape(&self.gpu, count, cols)?.clone();
        let idx = upload_words(&self.gpu, "rows", rows);
        let gather = (!rows.is_empty()).then_some((&idx, 0));
        self.norm_rows(
            x.buf()?,
            count,
            cols,
            Some((&norm.buf, eps)),
            gather,
            &y,
            false,
        );
        Ok(())
    }

    fn gate_sigmoid(&mut self, x: &mut Act, gate: &Act) -> Result<()> {
        if x.len() != gate.len() {
            bail!("a gate of {} for {} values", gate.len(), x.len());
        }
        let k = self.kernels.clone();
        self.pointwise(
            &k.gate_sigmoid,
            gate.buf()?,
            x.buf()?,
            [x.len() as u32, 0, 0, 0],
        );
        Ok(())
    }

    fn logits(
        &mut self,
        s: &Step<Self>,
        x: &Act,
        norm: &Vector,
        eps: f32,
        head: &Linear,
        softcap: Option<f32>,
    ) -> Result<()> {
        let mut sel = std::mem::take(&mut self.normed);
        let mut out = std::mem::take(&mut self.out);
        let r = self.select_logits(s, x, norm, eps, head, &mut sel, &mut out);
        (self.normed, self.out) = (sel, out);
        r?;
        if let Some(cap) = softcap {
            let (k, y) = (self.kernels.clone(), self.out.buf()?.clone());
            let n = self.out.len() as u32;
            self.pointwise(&k.softcap, &k.empty, &y, [n, 0, 0, cap.to_bits()]);
        }
        Ok(())
    }

    fn hidden(&mut self, s: &Step<Self>, x: &Act, norm: Option<(&Vector, f32)>) -> Result<()> {
        let rows = s.host.logits_indices.len();
        let y = self.out.shape(&self.gpu, rows, x.cols)?.clone();
        let gather = Some((&s.inputs.buf, s.inputs.rows));
        let norm = norm.map(|(w, eps)| (&w.buf, eps));
        self.norm_rows(x.buf()?, rows, x.cols, norm, gather, &y, false);
        Ok(())
    }

    fn host_logits(&mut self) -> Result<&mut [f32]> {
        Ok(&mut self.host_logits)
    }

    fn describe(&self) -> String {
        format!(
            "backend wgpu ({}), weights f16, activations f32",
            self.gpu.describe()
        )
    }
}

/// Ids past the whole vocabulary are refused here: a kernel cannot fail.
fn check_ids(ids: &[u32], e: &Embedding) -> Result<()> {
    let vocab = e.table.rows;
    match ids.iter().find(|&&id| e.first == 0 && id as usize >= vocab) {
        Some(id) => bail!("row {id} of a table of {vocab}"),
        None => Ok(()),
    }
}

fn embed_params(e: &Embedding, ids_at: u32, scale: f32, add: bool) -> [u32; 6] {
    [
        e.table.cols as u32,
        ids_at,
        e.first as u32,
        e.table.rows as u32,
        scale.to_bits(),
        add as u32,
    ]
}
