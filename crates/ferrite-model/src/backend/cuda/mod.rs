//! The CUDA backend (cargo feature `cuda`): bf16 weights on one GPU (or a GGUF's quantized
//! blocks, through candle's kernels), ferrite's own kernels for attention, the K/V write,
//! norms and activations, cuBLAS for the matmuls of many rows and ferrite's fused small-row
//! matmuls for decodes of one or two requests and one request's verify steps; decode and
//! verify steps replayed from CUDA graphs. The
//! residual stream stays in f32 and is updated by the matmuls' epilogues.

pub mod collectives;
pub mod device;
pub mod graph;
pub mod inputs;
pub mod kernels;
pub mod linear;
pub mod moe;
pub mod start;
mod step;

use super::{
    AttentionSpec, Backend, Epilogue, Forward, GdnParams, GdnSpec, LinearIn, MoeBytes, MoeMatrices,
    MoeSpec, Pointwise, QkvPrep, Rounding, Stack, Step,
};
use crate::config::RopeStyle;
use crate::kv_dtype::KvCacheDtype;
use crate::parallel::Group;
use crate::rope::{RopeSpec, RopeTable};
use crate::settings::DeviceKind;
use crate::step::DeviceDraws;
use crate::step::PackedStep;
use anyhow::{bail, Context, Result};
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};
use collectives::Collectives;
use device::cuda;
pub use device::open_device;
use graph::{DecodeGraphs, GraphShape};
use inputs::{u32s, StepInputs};
pub use kernels::attention::KvPages;
use kernels::attention::{AttentionShape, QkvParams};
use kernels::gdn::GdnStep;
use kernels::matmul::MatIn;
use kernels::Kernels;
use linear::Linear;
use std::sync::Arc;

/// An activation: f32 for the residual stream, bf16 for the rest; allocated by the op that
/// writes it (inside a captured graph, from the graph's own memory).
#[derive(Default)]
pub struct Act(Option<Tensor>);

impl Act {
    pub fn get(&self) -> Result<&Tensor> {
        self.0
            .as_ref()
            .context("activation read before it was written")
    }
}

/// The embedding table, bf16 `[rows, hidden]`: the whole vocabulary, or a tensor-parallel
/// rank's rows from token `first` on.
pub struct Embedding {
    table: Tensor,
    first: usize,
}

/// Rotary tables `[max_positions, dim / 2]` f32.
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    dim: usize,
    neox: bool,
}

pub struct CudaBackend {
    device: Device,
    /// Shared with the graph replays, which launch ops while the backend is borrowed.
    kernels: Arc<Kernels>,
    /// Keep GGUF blocks quantized where candle's kernels take them.
    quantized: bool,
    name: String,
    /// The last step's logits `[rows, vocab]` f32 and drawn tokens, on the device.
    logits: Option<Tensor>,
    tokens: Option<Tensor>,
    host_logits: Vec<f32>,
    graphs: DecodeGraphs,
    /// The ranks of a split model and how this one exchanges activations with them.
    group: Option<(Group, Collectives)>,
}

impl CudaBackend {
    pub fn new(device: Device, quantized: bool, name: String) -> Result<Self> {
        let kernels = Arc::new(Kernels::load(cuda(&device)?)?);
        Ok(Self {
            device,
            kernels,
            quantized,
            name,
            logits: None,
            tokens: None,
            host_logits: Vec::new(),
            graphs: DecodeGraphs::default(),
            group: None,
        })
    }

    /// This backend as a rank of `g`; `own_gpu`: no other rank of the group shares its GPU.
    pub fn in_group(mut self, g: Group, own_gpu: bool) -> Result<Self> {
        let c = Collectives::new(&g, &self.device, own_gpu)?;
        self.group = Some((g, c));
        Ok(self)
    }

    /// The GPU and its name, for log lines.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Replays decode and verify steps of up to `shape.max_batch` requests from CUDA graphs,
    /// padding rows writing into `shape.scratch_block`, a block the scheduler never hands out.
    pub fn enable_decode_graphs(&mut self, shape: GraphShape) -> Result<()> {
        self.graphs = DecodeGraphs::new(cuda(&self.device)?, shape)?;
        Ok(())
    }

    /// Graphs captured for steps of `window` rows per request (1: decodes).
    pub fn graphs_captured(&self, window: usize) -> usize {
        self.graphs.captured(window)
    }

    /// The last step's logits on the device.
    pub fn device_logits(&self) -> Result<&Tensor> {
        self.logits.as_ref().context("no step has run")
    }
}

/// What a matmul reads: the RMSNorm of the f32 residual stream folds into the matmul.
fn mat_in<'a>(input: &'a LinearIn<'a, CudaBackend>) -> Result<MatIn<'a>> {
    Ok(match input {
        LinearIn::Plain(a) => MatIn::Bf16(a.get()?),
        LinearIn::RmsNorm { x, norm, eps } => MatIn::Rms {
            x: x.get()?,
            rows: None,
            norm,
            eps: *eps,
        },
    })
}

fn shape(a: &AttentionSpec, pages: &KvPages) -> AttentionShape {
    AttentionShape {
        num_heads: a.num_heads,
        num_kv_heads: a.num_kv_heads,
        head_dim: a.head_dim,
        block_size: pages.block_size,
        scale: a.scale,
        sliding_window: a.sliding_window.unwrap_or(0),
        softcap: a.softcap.unwrap_or(0.0),
    }
}

/// What the CUDA backend does not run yet (embedding models run on `--device cpu`).
const ENCODERS: &str = "encoder models (BERT) run on the CPU backend only; use --device cpu";

impl Backend for CudaBackend {
    type Act = Act;
    /// bf16.
    type Vector = Tensor;
    type Linear = Linear;
    type Embedding = Embedding;
    type Rope = Rope;
    type Moe = moe::Moe;
    type LayerCache = KvPages;
    /// `[slots, spec.state_elems()]` f32.
    type StateCache = Tensor;
    type StepInputs = StepInputs;
    /// Every op allocates its output on the stream; inside a captured graph, what the graph
    /// allocated must also be freed in it.
    const REUSES_ACTIVATIONS: bool = false;

    fn vector(&self, v: Vec<f32>) -> Result<Tensor> {
        let n = v.len();
        Ok(Tensor::from_vec(v, n, &self.device)?.to_dtype(DType::BF16)?)
    }

    /// Activations stay bf16 whatever `_input` asks.
    fn linear(&self, parts: Vec<QTensor>, stack: Stack, _input: Rounding) -> Result<Linear> {
        linear::upload(&parts, stack, self.quantized, &self.device)
    }

    fn embedding(&self, table: QTensor) -> Result<Embedding> {
        self.vocab_embedding(table, 0)
    }

    fn vocab_embedding(&self, table: QTensor, first: usize) -> Result<Embedding> {
        Ok(Embedding {
            table: linear::bf16(&table, &self.device)?,
            first,
        })
    }

    fn random_linear(
        &self,
        rows: &[usize],
        cols: usize,
        _stack: Stack,
        _input: Rounding,
    ) -> Result<Linear> {
        let total = rows.iter().sum();
        Ok(Linear::Dense(linear::random(total, cols, &self.device)?))
    }

    fn random_embedding(&self, vocab: usize, hidden: usize) -> Result<Embedding> {
        Ok(Embedding {
            table: linear::random(vocab, hidden, &self.device)?,
            first: 0,
        })
    }

    fn rope(&self, spec: &RopeSpec, max_positions: usize) -> Result<Rope> {
        let table = RopeTable::new(spec, max_positions);
        let (cos, sin) = table.tables();
        let half = spec.dim / 2;
        Ok(Rope {
            cos: Tensor::from_slice(cos, (max_positions, half), &self.device)?,
            sin: Tensor::from_slice(sin, (max_positions, half), &self.device)?,
            dim: spec.dim,
            neox: spec.style == RopeStyle::Neox,
        })
    }

    fn moe(&self, m: MoeMatrices, spec: MoeSpec) -> Result<moe::Moe> {
        moe::Moe::new(m, spec, &self.device)
    }

    fn random_moe(
        &self,
        spec: MoeSpec,
        inter: usize,
        shared_inter: Option<usize>,
        hidden: usize,
    ) -> Result<moe::Moe> {
        moe::Moe::random(spec, inter, shared_inter, hidden, &self.device)
    }

    fn moe_bytes(&self, m: &moe::Moe) -> MoeBytes {
        m.bytes()
    }

    fn linear_bytes(&self, w: &Linear) -> usize {
        w.bytes()
    }

    fn embedding_bytes(&self, e: &Embedding) -> usize {
        e.table.elem_count() * e.table.dtype().size_in_bytes()
    }

    fn layer_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: KvCacheDtype,
    ) -> Result<KvPages> {
        KvPages::zeros(
            num_blocks,
            kv_heads,
            block_size,
            head_dim,
            dtype.resolve(DeviceKind::Cuda(0).auto_kv_dtype()),
            &self.device,
        )
    }

    fn state_cache(&self, slots: usize, spec: &GdnSpec) -> Result<Tensor> {
        // At load, not at the first step: the delta rule is built for these key heads.
        if !kernels::gdn::RULE_KEY_DIMS.contains(&spec.k_dim) {
            bail!(
                "linear-attention key heads of {} (the CUDA kernels take {:?})",
                spec.k_dim,
                kernels::gdn::RULE_KEY_DIMS
            );
        }
        Ok(Tensor::zeros(
            (slots, spec.state_elems()),
            DType::F32,
            &self.device,
        )?)
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
        out.0 = Some(
            self.kernels
                .embed(&s.inputs.ids, &e.table, e.first, scale.unwrap_or(1.0))?,
        );
        Ok(())
    }

    fn matmul(&mut self, input: LinearIn<Self>, w: &Linear, out: Epilogue<Self>) -> Result<()> {
        let k = &self.kernels;
        let input = mat_in(&input)?;
        match out {
            Epilogue::Store(out) => out.0 = Some(k.matmul(input, w, DType::BF16)?),
            Epilogue::StoreResidual(out) => out.0 = Some(k.matmul(input, w, DType::F32)?),
            Epilogue::AddInto(residual) => k.matmul_add(input, w, residual.get()?)?,
            Epilogue::AddNormedInto {
                residual,
                norm,
                eps,
            } => {
                let y = k.matmul(input, w, DType::F32)?;
                k.add_rms_norm(residual.get()?, &y, norm, eps)?;
            }
            Epilogue::Gated(out, act) => out.0 = Some(k.matmul_gated(input, w, act)?),
        }
        Ok(())
    }

    fn mixture(&mut self, x: &mut Act, norm: &Tensor, eps: f32, m: &moe::Moe) -> Result<()> {
        moe::mixture(&self.kernels, x.get()?, norm, eps, m)
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
        let Some(rope) = p.rope else {
            bail!("{ENCODERS}");
        };
        let params = QkvParams {
            bias: p.bias,
            q_norm: p.q_norm,
            k_norm: p.k_norm,
            eps: p.eps,
            rope_cos: &rope.cos,
            rope_sin: &rope.sin,
            rope_dim: rope.dim,
            neox: rope.neox,
        };
        let out = self.kernels.qkv_rope_write(
            qkv.get()?,
            &s.inputs.positions,
            &s.inputs.groups[a.kv_group].slots,
            cache,
            &shape(a, cache),
            &params,
        )?;
        q.0 = Some(out);
        Ok(())
    }

    fn attention(
        &mut self,
        s: &Step<Self>,
        q: &Act,
        cache: &KvPages,
        a: &AttentionSpec,
        sinks: Option<&Tensor>,
        out: &mut Act,
    ) -> Result<()> {
        if !a.causal {
            bail!("{ENCODERS}");
        }
        let meta = s.inputs.meta(a.kv_group);
        let o = self
            .kernels
            .paged_attention(q.get()?, cache, &meta, &shape(a, cache), sinks)?;
        out.0 = Some(o);
        Ok(())
    }

    fn gated_delta(
        &mut self,
        s: &Step<Self>,
        proj: &Act,
        p: &GdnParams<Self>,
        spec: &GdnSpec,
        state: &mut Tensor,
        out: &mut Act,
    ) -> Result<()> {
        let i = s.inputs;
        let step = GdnStep {
            cu_seqlens: &i.cu_seqlens_q,
            positions: &i.positions,
            slots: &i.state_slots,
            restores: i.state_moves.as_ref().map(|m| &m.restores),
            saves: i.state_moves.as_ref().map(|m| &m.saves),
            drafts: i.state_moves.as_ref().and_then(|m| m.drafts.as_ref()),
            num_seqs: i.num_seqs,
            prefill: i.max_query_len > 1,
        };
        let o = self.kernels.gated_delta(
            &step,
            proj.get()?,
            spec,
            state,
            p.conv,
            p.a_log,
            p.dt_bias,
            p.norm,
        )?;
        out.0 = Some(o);
        Ok(())
    }

    fn gate_sigmoid(&mut self, x: &mut Act, gate: &Act) -> Result<()> {
        self.kernels.gate_sigmoid(x.get()?, gate.get()?)
    }

    fn logits(
        &mut self,
        s: &Step<Self>,
        x: &Act,
        norm: &Tensor,
        eps: f32,
        head: &Linear,
        softcap: Option<f32>,
    ) -> Result<()> {
        // Only the rows that need logits get the final norm and the head.
        let input = MatIn::Rms {
            x: x.get()?,
            rows: Some(&s.inputs.rows),
            norm,
            eps,
        };
        let logits = self.kernels.matmul(input, head, DType::F32)?;
        if let Some(cap) = softcap {
            self.kernels.softcap(&logits, cap)?;
        }
        self.logits = Some(logits);
        Ok(())
    }

    fn rms_norm_rows(
        &mut self,
        x: &Act,
        rows: &[u32],
        norm: &Tensor,
        eps: f32,
        out: &mut Act,
    ) -> Result<()> {
        let rows = (!rows.is_empty())
            .then(|| u32s(rows, &self.device))
            .transpose()?;
        out.0 = Some(
            self.kernels
                .rms_norm(x.get()?, rows.as_ref(), norm, eps, DType::F32)?,
        );
        Ok(())
    }

    fn hidden(&mut self, s: &Step<Self>, x: &Act, norm: Option<(&Tensor, f32)>) -> Result<()> {
        let rows = &s.inputs.rows;
        let hidden = match norm {
            Some((w, eps)) => self
                .kernels
                .rms_norm(x.get()?, Some(rows), w, eps, DType::F32)?,
            None => x.get()?.index_select(rows, 0)?.to_dtype(DType::F32)?,
        };
        self.logits = Some(hidden);
        Ok(())
    }

    fn add_rows(&mut self, _t: &Embedding, _ids: &[u32], _x: &mut Act) -> Result<()> {
        bail!("{ENCODERS}")
    }

    fn add_bias(&mut self, _x: &mut Act, _b: &Tensor, _then: Option<Pointwise>) -> Result<()> {
        bail!("{ENCODERS}")
    }

    fn layer_norm(&mut self, _x: &mut Act, _w: &Tensor, _b: &Tensor, _eps: f32) -> Result<()> {
        bail!("{ENCODERS}")
    }

    fn host_logits(&mut self) -> Result<&mut [f32]> {
        self.host_logits = self.device_logits()?.flatten_all()?.to_vec1()?;
        Ok(&mut self.host_logits)
    }

    fn group(&self) -> Option<&Group> {
        self.group.as_ref().map(|(g, _)| g)
    }

    fn all_reduce(&mut self, x: &mut Act) -> Result<()> {
        let Some((g, c)) = &self.group else {
            bail!("an all-reduce outside a tensor-parallel group");
        };
        if let Some(sum) = c.all_reduce(g, x.get()?)? {
            x.0 = Some(sum);
        }
        Ok(())
    }

    fn send_next(&mut self, x: &Act) -> Result<()> {
        match &self.group {
            Some((g, c)) if !g.pp.is_last() => {
                c.send(g, x.get()?, g.world_rank(g.pp.stage + 1, g.tp.rank))
            }
            _ => bail!("no next pipeline stage to send to"),
        }
    }

    fn recv_prev(&mut self, x: &mut Act, rows: usize, cols: usize) -> Result<()> {
        match &self.group {
            Some((g, c)) if !g.pp.is_first() => {
                let from = g.world_rank(g.pp.stage - 1, g.tp.rank);
                x.0 = Some(c.recv(g, (rows, cols), from, &self.device)?);
                Ok(())
            }
            _ => bail!("no previous pipeline stage to receive from"),
        }
    }

    /// A split model's logits are shards of the vocabulary, gathered and drawn from on the
    /// leader's host.
    fn draws_on_device(&self) -> bool {
        self.group.is_none()
    }

    fn drawn_tokens(&mut self) -> Result<Vec<u32>> {
        Ok(self
            .tokens
            .take()
            .context("the step drew no tokens")?
            .to_vec1()?)
    }

    fn describe(&self) -> String {
        let weights = if self.quantized {
            "GGUF blocks through candle's quantized matmuls where they allow, the rest bf16"
        } else {
            "bf16 weights"
        };
        let split = match &self.group {
            Some((g, c)) => format!(
                ", tensor-parallel rank {} of {}, pipeline stage {} of {}, collectives {}",
                g.tp.rank,
                g.tp.size,
                g.pp.stage,
                g.pp.stages,
                c.describe()
            ),
            None => String::new(),
        };
        let kernels = match self.kernels.batch_invariant() {
            true => "ferrite CUDA, batch-invariant matmuls and unsplit attention",
            false => "ferrite CUDA + cuBLAS",
        };
        format!(
            "backend {} ({weights}{split}), kernels: {kernels}",
            self.name
        )
    }
}
