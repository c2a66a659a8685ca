//! The backend trait's ops on wgpu: checks on the host, then the launches.

use super::attention::{KvPages, QkvArgs, StepView};
use super::gdn::{self, StateCache};
use super::inputs::StepInputs;
use super::kernels::launch;
use super::launches::{check_ids, embed_params, x_of, YOut};
use super::linear::{fuses, Linear, Pick};
use super::moe::{self, Moe};
use super::tensors::{upload_f32, upload_words, Act, Vector};
use super::{attention, Embedding, Rope, WgpuBackend};
use crate::backend::{
    random_matrix, AttentionSpec, Backend, Epilogue, Forward, GdnParams, GdnSpec, LinearIn,
    MoeBytes, MoeMatrices, MoeSpec, Pointwise, QkvPrep, Rounding, Stack, Step,
};
use crate::config::RopeStyle;
use crate::kv_dtype::KvCacheDtype;
use crate::rope::{RopeSpec, RopeTable};
use crate::settings::{DeviceKind, GpuApi};
use crate::step::{DeviceDraws, PackedStep};
use anyhow::{bail, Result};
use candle_core::quantized::QTensor;

impl Backend for WgpuBackend {
    type Act = Act;
    type Vector = Vector;
    type Linear = Linear;
    type Embedding = Embedding;
    type Rope = Rope;
    type LayerCache = KvPages;
    type Moe = Moe;
    type StateCache = StateCache;
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

    /// Drawn cheaply on the host (Q8_0 blocks from a pool) where the rows are whole blocks.
    fn random_linear(
        &self,
        rows: &[usize],
        cols: usize,
        _stack: Stack,
        _input: Rounding,
    ) -> Result<Linear> {
        match cols % 32 {
            0 => Linear::random(&self.gpu, rows, cols),
            _ => {
                let parts = rows.iter().map(|&r| random_matrix(r, cols));
                Linear::upload(&self.gpu, &parts.collect::<Result<Vec<_>>>()?)
            }
        }
    }

    fn random_embedding(&self, vocab: usize, hidden: usize) -> Result<Embedding> {
        match hidden % 32 {
            0 => Ok(Embedding {
                table: Linear::random(&self.gpu, &[vocab], hidden)?,
                first: 0,
            }),
            _ => self.embedding(random_matrix(vocab, hidden)?),
        }
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

    fn moe(&self, m: MoeMatrices, spec: MoeSpec) -> Result<Moe> {
        Moe::upload(&self.gpu, m, spec)
    }

    fn linear_bytes(&self, w: &Linear) -> usize {
        w.bytes()
    }

    fn embedding_bytes(&self, e: &Embedding) -> usize {
        e.table.bytes()
    }

    fn moe_bytes(&self, m: &Moe) -> MoeBytes {
        m.bytes()
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
        KvPages::zeros(
            (&self.gpu, &self.kernels),
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            dtype,
        )
    }

    fn state_cache(&self, slots: usize, spec: &GdnSpec) -> Result<StateCache> {
        StateCache::zeros(&self.gpu, &self.kernels, slots, spec)
    }

    fn step(
        &mut self,
        host: &PackedStep,
        draws: Option<DeviceDraws>,
        forward: Forward<Self>,
    ) -> Result<()> {
        self.run_step(host, draws, forward)
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
            &gpu,
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
                self.project(&input, w, YOut::Store(y), 0)?;
            }
            Epilogue::AddInto(residual) => {
                self.project(&input, w, YOut::Add(residual), 0)?;
            }
            Epilogue::AddNormedInto {
                residual,
                norm,
                eps,
            } => {
                let mut proj = std::mem::take(&mut self.proj);
                let r = self.project(&input, w, YOut::Store(&mut proj), 0);
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
                // 0 SiLU, 1 GELU (tanh), as the kernels number them.
                let op = match act {
                    crate::backend::Activation::Silu => 0,
                    crate::backend::Activation::GeluTanh => 1,
                };
                let rows = x_of(&input).rows;
                if fuses(&self.kernels, w, rows, self.pick, true) {
                    self.project(&input, w, YOut::Store(out), op + 1)?;
                    return Ok(());
                }
                let mut proj = std::mem::take(&mut self.proj);
                let r = self.project(&input, w, YOut::Store(&mut proj), 0);
                self.proj = proj;
                let rows = r?;
                let proj = self.proj.buf()?.clone();
                let inter = w.rows / 2;
                let y = out.shape(&self.gpu, rows, inter)?.clone();
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

    fn mixture(&mut self, x: &mut Act, norm: &Vector, eps: f32, m: &Moe) -> Result<()> {
        if x.cols != m.router().cols {
            bail!(
                "experts over {} columns for rows of {}",
                m.router().cols,
                x.cols
            );
        }
        let mut s = std::mem::take(&mut self.moe);
        // The normed rows: the router's input and every expert's.
        let mut normed = std::mem::take(&mut self.normed);
        let r = normed.shape(&self.gpu, x.rows, x.cols).cloned();
        let r = r.and_then(|nb| {
            let norm = Some((&norm.buf, eps));
            self.norm_rows(x.buf()?, x.rows, x.cols, norm, None, &nb, false);
            let router = LinearIn::Plain(&normed);
            self.project(&router, m.router(), YOut::Store(s.logits()), 0)?;
            if let Some([gate_up, down]) = m.shared() {
                let (act, out) = s.shared();
                let gated = Epilogue::Gated(act, m.spec().act);
                self.matmul(LinearIn::Plain(&normed), gate_up, gated)?;
                self.project(&LinearIn::Plain(act), down, YOut::Store(out), 0)?;
            }
            let (gpu, k) = (self.gpu.clone(), self.kernels.clone());
            moe::route_and_run(&gpu, &k, self.pass(), m, &mut s, (normed.buf()?, x))
        });
        (self.moe, self.normed) = (s, normed);
        r
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
        let q_w = a.num_heads * a.head_dim;
        a.check_qkv_width(qkv.cols)?;
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
        let longest = s.host.seq_lens_k.iter().max().copied().unwrap_or(0) as usize;
        let cpu = self.pick == Pick::Cpu;
        let splits = attention::key_splits(cpu, q.rows * a.num_heads, longest);
        let parts = match splits {
            1 => None,
            _ => {
                let rows = q.rows * a.num_heads * splits;
                Some((
                    self.parts.shape(&gpu, rows, a.head_dim + 2)?.clone(),
                    splits,
                ))
            }
        };
        let sinks = sinks.map(|v| &v.buf);
        attention::attention(
            &gpu,
            &k,
            self.pass(),
            &view,
            (cache, a),
            sinks,
            (q.buf()?, &y, parts.as_ref().map(|(b, n)| (b, *n))),
        );
        Ok(())
    }

    fn gated_delta(
        &mut self,
        s: &Step<Self>,
        proj: &Act,
        p: &GdnParams<Self>,
        spec: &GdnSpec,
        state: &mut StateCache,
        out: &mut Act,
    ) -> Result<()> {
        if proj.cols != spec.proj_dim() || state.spec() != spec {
            bail!(
                "gated delta-net input {} wide, expected {}",
                proj.cols,
                spec.proj_dim()
            );
        }
        if proj.rows > 65535 {
            bail!("{} tokens in one step: at most 65535", proj.rows);
        }
        let gpu = self.gpu.clone();
        let y = out
            .shape(&gpu, proj.rows, spec.num_v_heads * spec.v_dim)?
            .clone();
        let conv_out = self.conv.shape(&gpu, proj.rows, spec.conv_dim())?.clone();
        let buffers = gdn::Buffers {
            proj: proj.buf()?,
            conv_out: &conv_out,
            conv: &p.conv.buf,
            a_log: &p.a_log.buf,
            dt_bias: &p.dt_bias.buf,
            norm: &p.norm.buf,
            out: &y,
        };
        let k = self.kernels.clone();
        gdn::gated_delta(&gpu, &k, self.pass(), s.inputs, &buffers, state);
        Ok(())
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

    fn draws_on_device(&self) -> bool {
        true
    }

    fn drawn_tokens(&mut self) -> Result<Vec<u32>> {
        Ok(std::mem::take(&mut self.drawn))
    }

    fn describe(&self) -> String {
        format!(
            "backend wgpu ({}), weights: GGUF Q8_0/Q4_0/Q4_1 blocks kept, Q4_K/Q5_K/Q6_K cut into blocks of 32, others f16; activations f32",
            self.gpu.describe()
        )
    }
}
