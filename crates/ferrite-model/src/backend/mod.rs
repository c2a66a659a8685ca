//! The backend trait: the coarse ops a model family is written against, so that each
//! family is written once and each device keeps its fusions (a linear layer takes its
//! input as the RMSNorm of the residual and ends in an epilogue; Q/K/V preparation is one
//! op). Families are generic over `B: Backend`: every op is statically dispatched.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "wgpu")]
pub mod wgpu;

use crate::kv_dtype::KvCacheDtype;
use crate::parallel::{Group, PipelineStage, TensorParallel};
use crate::rope::RopeSpec;
use crate::step::DeviceDraws;
use crate::step::PackedStep;
use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};

/// The gated activation of an MLP: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

/// An element-wise function after a bias (encoders' MLPs and pooler heads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pointwise {
    /// GELU, erf form (BERT's `gelu`).
    Gelu,
    Tanh,
}

/// How projections of one input are laid out in one weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stack {
    /// Outputs side by side in the order given (Q|K|V).
    Concat,
    /// `[gate, up]`, read by [`Epilogue::Gated`]; the backend picks the row order.
    GateUp,
}

/// How much rounding a matrix's input tolerates. The backend may round a `Coarse` input
/// (the CPU's int8 path: 8 bits per block of 32) but carries a `Fine` one to about 16 bits:
/// the inputs of Q/K/V (whose errors softmax amplifies) and of the LM head, measured against
/// transformers (`tests/oracle.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rounding {
    #[default]
    Coarse,
    Fine,
}

/// What a linear layer reads.
pub enum LinearIn<'a, B: Backend> {
    Plain(&'a B::Act),
    /// The RMSNorm of `x` (the residual stream) with weight `norm`.
    RmsNorm {
        x: &'a B::Act,
        norm: &'a B::Vector,
        eps: f32,
    },
}

/// Where a linear layer's output goes.
pub enum Epilogue<'a, B: Backend> {
    Store(&'a mut B::Act),
    /// Stored as the residual stream is (f32 on every backend): a sum to add into.
    StoreResidual(&'a mut B::Act),
    /// `residual += y`.
    AddInto(&'a mut B::Act),
    /// `residual += rms_norm(y)` (Gemma's norms after attention and MLP).
    AddNormedInto {
        residual: &'a mut B::Act,
        norm: &'a B::Vector,
        eps: f32,
    },
    /// `out = act(gate) * up` over a [`Stack::GateUp`] weight.
    Gated(&'a mut B::Act, Activation),
}

/// One attention layer's shape and options.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionSpec {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub sliding_window: Option<usize>,
    /// `cap * tanh(score / cap)` before the softmax (Gemma 2).
    pub softcap: Option<f32>,
    /// Each query sees keys up to its own position; false: every key of its request
    /// (encoders, whose prompts are computed in one step).
    pub causal: bool,
    /// The layer's KV group (whose block tables it reads) and its slot in a page (which of
    /// the backend's layer caches holds it); see `ferrite_core::kv_layout`.
    pub kv_group: usize,
    pub kv_slot: usize,
}

impl AttentionSpec {
    /// Refuses a fused projection that is not Q|K|V of this layer's heads.
    pub fn check_qkv_width(&self, cols: usize) -> Result<()> {
        let want = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim;
        match cols == want {
            true => Ok(()),
            false => bail!("QKV projection is {cols} wide, expected {want}"),
        }
    }

    /// This spec for layer `layer` of `layout`.
    pub fn at(self, layout: &ferrite_core::kv_layout::KvLayout, layer: usize) -> Self {
        Self {
            kv_group: layout.layer_group[layer],
            kv_slot: layout.layer_slot[layer],
            ..self
        }
    }
}

/// Everything between the QKV projection and attention: bias, per-head Q/K RMSNorm,
/// rotary embedding, and the K/V write into the paged cache by slot mapping.
pub struct QkvPrep<'a, B: Backend> {
    pub bias: Option<&'a B::Vector>,
    pub q_norm: Option<&'a B::Vector>,
    pub k_norm: Option<&'a B::Vector>,
    pub eps: f32,
    /// `None`: positions enter elsewhere (absolute position embeddings).
    pub rope: Option<&'a B::Rope>,
}

/// How a mixture-of-experts layer routes its tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeSpec {
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The top-k softmax weights rescaled to sum to 1 (Mixtral, Qwen3-MoE); else kept as
    /// the softmax over all experts gives them (Qwen2-MoE).
    pub norm_topk: bool,
    pub act: Activation,
}

/// A gated delta-net (linear attention) layer's shape (Qwen3-Next, Qwen3.5).
#[derive(Clone, Debug, PartialEq)]
pub struct GdnSpec {
    pub num_k_heads: usize,
    /// A multiple of `num_k_heads`: each key head serves that many value heads in turn.
    pub num_v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    /// Taps of the causal depthwise convolution over Q|K|V.
    pub conv_kernel: usize,
    /// Of the output's gated RMSNorm.
    pub eps: f32,
}

impl GdnSpec {
    /// Channels of the convolution: Q, K and V.
    pub fn conv_dim(&self) -> usize {
        2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim
    }

    /// Width of the layer's input projection: Q|K|V, then the output gate z, then the
    /// per-head b (update strength) and a (decay).
    pub fn proj_dim(&self) -> usize {
        self.conv_dim() + self.num_v_heads * self.v_dim + 2 * self.num_v_heads
    }

    /// f32 values of one request's state: the convolution's last `conv_kernel - 1` inputs
    /// and the delta rule's `[v_heads, k_dim, v_dim]` matrix.
    pub fn state_elems(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1) + self.num_v_heads * self.k_dim * self.v_dim
    }
}

/// A gated delta-net layer's small weights.
pub struct GdnParams<'a, B: Backend> {
    /// `[conv_dim, conv_kernel]`, the last tap on the current token.
    pub conv: &'a B::Vector,
    /// Per value head: the decay's log rate and its time-step bias.
    pub a_log: &'a B::Vector,
    pub dt_bias: &'a B::Vector,
    /// `[v_dim]`: the output's gated RMSNorm.
    pub norm: &'a B::Vector,
}

/// One expert's gated MLP as host matrices: gate and up `[inter, hidden]`, down
/// `[hidden, inter]`.
pub struct ExpertMatrices {
    pub gate: QTensor,
    pub up: QTensor,
    pub down: QTensor,
}

/// A mixture-of-experts layer's host weights.
pub struct MoeMatrices {
    /// `[num_experts, hidden]`.
    pub router: QTensor,
    pub experts: Vec<ExpertMatrices>,
    /// An expert every token takes (Qwen2-MoE, Qwen3.5), with `shared_gate` (`[1, hidden]`)
    /// when its output is scaled by `sigmoid(shared_gate . x)`.
    pub shared: Option<ExpertMatrices>,
    pub shared_gate: Option<QTensor>,
}

/// Random expert matrices (`--load-format dummy`): `inter` wide, `hidden` deep.
pub fn random_expert(inter: usize, hidden: usize) -> Result<ExpertMatrices> {
    Ok(ExpertMatrices {
        gate: random_matrix(inter, hidden)?,
        up: random_matrix(inter, hidden)?,
        down: random_matrix(hidden, inter)?,
    })
}

/// Weight bytes of mixture-of-experts layers (summed over layers with `+`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MoeBytes {
    /// Every routed expert's matrices.
    pub routed: usize,
    /// What every token reads: routers and shared experts.
    pub always: usize,
    pub num_experts: usize,
    pub top_k: usize,
}

impl MoeBytes {
    pub fn total(&self) -> usize {
        self.routed + self.always
    }

    /// Bytes a step of `tokens` rows reads, expected with each row's `top_k` experts drawn
    /// uniformly: each expert is hit with probability `1 - (1 - k / E)^tokens`.
    pub fn read_by(&self, tokens: usize) -> f64 {
        if self.num_experts == 0 {
            return self.always as f64;
        }
        let miss = 1.0 - self.top_k as f64 / self.num_experts as f64;
        self.always as f64 + self.routed as f64 * (1.0 - miss.powi(tokens as i32))
    }
}

impl std::ops::Add for MoeBytes {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self {
            routed: self.routed + o.routed,
            always: self.always + o.always,
            num_experts: self.num_experts.max(o.num_experts),
            top_k: self.top_k.max(o.top_k),
        }
    }
}

/// A step as the ops see it: the host's index arrays and the backend's copy of them.
pub struct Step<'a, B: Backend> {
    pub host: &'a PackedStep,
    pub inputs: &'a B::StepInputs,
}

/// A family's forward pass over one step: launches every op, leaves the logits in the
/// backend ([`Backend::logits`]).
pub type Forward<'a, B> = &'a mut (dyn FnMut(&mut B, &Step<B>) -> Result<()> + Send);

/// A random `[rows, cols]` matrix on the host, normal with std 0.02 (activations keep a
/// realistic scale); in Q8_0 blocks where the width allows, as quantized checkpoints come.
pub fn random_matrix(rows: usize, cols: usize) -> Result<QTensor> {
    let t = candle_core::Tensor::randn(0f32, 0.02, (rows, cols), &candle_core::Device::Cpu)?;
    let dtype = match cols % 32 {
        0 => GgmlDType::Q8_0,
        _ => GgmlDType::F32,
    };
    Ok(QTensor::quantize(&t, dtype)?)
}

pub trait Backend: Send + Sized {
    /// Activations `[rows, width]`.
    type Act: Default + Send;
    /// A small vector: norm weights, biases.
    type Vector: Send + Sync;
    /// A weight matrix (or projections of one input stacked) as the backend multiplies it.
    type Linear: Send + Sync;
    type Embedding: Send + Sync;
    type Rope: Send + Sync;
    /// A mixture-of-experts layer: router, experts and shared expert.
    type Moe: Send + Sync;
    /// One layer's K and V pages.
    type LayerCache: Send;
    /// One gated delta-net layer's recurrent state for every state slot.
    type StateCache: Send;
    /// A step's index arrays where the ops read them.
    type StepInputs: Sync;
    /// Whether a step's activations stay allocated for the next step to write into (the
    /// CPU's buffers); otherwise they are dropped at the end of each step.
    const REUSES_ACTIVATIONS: bool = true;

    fn vector(&self, v: Vec<f32>) -> Result<Self::Vector>;
    fn linear(&self, parts: Vec<QTensor>, stack: Stack, input: Rounding) -> Result<Self::Linear>;
    fn embedding(&self, table: QTensor) -> Result<Self::Embedding>;
    /// Random weights of these shapes (`--load-format dummy`); a device may draw them itself.
    fn random_linear(
        &self,
        rows: &[usize],
        cols: usize,
        stack: Stack,
        input: Rounding,
    ) -> Result<Self::Linear> {
        let parts = rows.iter().map(|&r| random_matrix(r, cols));
        self.linear(parts.collect::<Result<_>>()?, stack, input)
    }
    fn random_embedding(&self, vocab: usize, hidden: usize) -> Result<Self::Embedding> {
        self.embedding(random_matrix(vocab, hidden)?)
    }
    /// Rows `first..` of the vocabulary's embedding table (a tensor-parallel shard): a
    /// token outside them embeds as zeros, which the group's all-reduce fills in.
    fn vocab_embedding(&self, table: QTensor, first: usize) -> Result<Self::Embedding> {
        match first {
            0 => self.embedding(table),
            _ => bail!("{}: no tensor parallelism", self.describe()),
        }
    }
    fn rope(&self, spec: &RopeSpec, max_positions: usize) -> Result<Self::Rope>;
    fn moe(&self, m: MoeMatrices, spec: MoeSpec) -> Result<Self::Moe>;
    /// Random experts `inter` wide (and a gated shared one `shared_inter` wide) over
    /// `hidden`, for `--load-format dummy`.
    fn random_moe(
        &self,
        spec: MoeSpec,
        inter: usize,
        shared_inter: Option<usize>,
        hidden: usize,
    ) -> Result<Self::Moe> {
        let m = MoeMatrices {
            router: random_matrix(spec.num_experts, hidden)?,
            experts: (0..spec.num_experts)
                .map(|_| random_expert(inter, hidden))
                .collect::<Result<_>>()?,
            shared: shared_inter.map(|i| random_expert(i, hidden)).transpose()?,
            shared_gate: shared_inter.map(|_| random_matrix(1, hidden)).transpose()?,
        };
        self.moe(m, spec)
    }
    /// Bytes a weight occupies on the device.
    fn linear_bytes(&self, w: &Self::Linear) -> usize;
    fn embedding_bytes(&self, e: &Self::Embedding) -> usize;
    /// Bytes of a mixture-of-experts layer.
    fn moe_bytes(&self, m: &Self::Moe) -> MoeBytes;
    /// `num_blocks` pages of `block_size` tokens for a layer of `kv_heads` x `head_dim`,
    /// holding `dtype` (a type the device does not store is refused).
    fn layer_cache(
        &self,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        dtype: KvCacheDtype,
    ) -> Result<Self::LayerCache>;

    /// `slots` requests' recurrent state of a gated delta-net layer `spec`.
    fn state_cache(&self, slots: usize, spec: &GdnSpec) -> Result<Self::StateCache>;

    /// Runs `forward` over `host` where the backend's ops belong (the CPU's compute threads;
    /// on a GPU, eagerly or from a captured graph). With `draws`, each logits row's token is
    /// also drawn on the device, for [`Backend::drawn_tokens`].
    fn step(
        &mut self,
        host: &PackedStep,
        draws: Option<DeviceDraws>,
        forward: Forward<Self>,
    ) -> Result<()>;
    /// The embedding rows of the step's tokens, times `scale` if given.
    fn embed(
        &mut self,
        s: &Step<Self>,
        table: &Self::Embedding,
        scale: Option<f32>,
        out: &mut Self::Act,
    ) -> Result<()>;
    fn matmul(
        &mut self,
        input: LinearIn<Self>,
        w: &Self::Linear,
        out: Epilogue<Self>,
    ) -> Result<()>;
    /// `x += ` the mixture of `rms_norm(x)`'s rows: each row through its top-k experts by
    /// the router's weights, plus the shared expert; a row's result never depends on which
    /// other rows share its experts.
    fn mixture(
        &mut self,
        x: &mut Self::Act,
        norm: &Self::Vector,
        eps: f32,
        m: &Self::Moe,
    ) -> Result<()>;
    /// Splits `qkv` (`[T, (H + 2 Hkv) D]`) into Q (returned in `q`) and K/V written to
    /// `cache`, after `prep`.
    fn prepare_qkv(
        &mut self,
        s: &Step<Self>,
        qkv: &Self::Act,
        prep: &QkvPrep<Self>,
        attn: &AttentionSpec,
        cache: &mut Self::LayerCache,
        q: &mut Self::Act,
    ) -> Result<()>;
    /// Paged varlen attention of every request of the step, causal, one call per layer;
    /// `sinks`: one logit per query head added to every row's softmax (gpt-oss).
    fn attention(
        &mut self,
        s: &Step<Self>,
        q: &Self::Act,
        cache: &Self::LayerCache,
        attn: &AttentionSpec,
        sinks: Option<&Self::Vector>,
        out: &mut Self::Act,
    ) -> Result<()>;
    /// The gated delta-net core of every request of the step, from its input projection
    /// `proj` (`[T, spec.proj_dim()]`) to the input of its output projection (`out`,
    /// `[T, v_heads * v_dim]`): the causal convolution (SiLU), L2-normed Q and K, the gated
    /// delta rule over each request's state slot (`host.state.slots`; started over at
    /// position 0), and the RMSNorm of each head's output gated by `silu(z)`.
    fn gated_delta(
        &mut self,
        s: &Step<Self>,
        proj: &Self::Act,
        p: &GdnParams<Self>,
        spec: &GdnSpec,
        state: &mut Self::StateCache,
        out: &mut Self::Act,
    ) -> Result<()>;
    /// `out[i] = rms_norm(x[rows[i]])` (every row when `rows` is empty), stored as the
    /// residual stream is: the hidden state an MTP head continues from.
    fn rms_norm_rows(
        &mut self,
        _x: &Self::Act,
        _rows: &[u32],
        _norm: &Self::Vector,
        _eps: f32,
        _out: &mut Self::Act,
    ) -> Result<()> {
        bail!("{}: no RMSNorm of selected rows yet", self.describe())
    }
    /// `x *= sigmoid(gate)`, element-wise (Qwen3.5's gated attention output).
    fn gate_sigmoid(&mut self, x: &mut Self::Act, gate: &Self::Act) -> Result<()>;
    /// Logits of the step's `logits_indices` rows: the final norm of those rows only, the
    /// LM head, then `cap * tanh(x / cap)` if `softcap`; kept for [`Backend::host_logits`].
    fn logits(
        &mut self,
        s: &Step<Self>,
        x: &Self::Act,
        norm: &Self::Vector,
        eps: f32,
        head: &Self::Linear,
        softcap: Option<f32>,
    ) -> Result<()>;
    /// Instead of logits (a pooling step): the `logits_indices` rows of `x`, RMS-normed when
    /// `norm` is given, kept for [`Backend::host_logits`] as `[rows, width]`.
    fn hidden(
        &mut self,
        s: &Step<Self>,
        x: &Self::Act,
        norm: Option<(&Self::Vector, f32)>,
    ) -> Result<()>;
    /// `x[i] += table[ids[i]]` per row (absolute positions, token types).
    fn add_rows(&mut self, table: &Self::Embedding, ids: &[u32], x: &mut Self::Act) -> Result<()>;
    /// `x += bias` per row, then `then` element-wise.
    fn add_bias(
        &mut self,
        x: &mut Self::Act,
        bias: &Self::Vector,
        then: Option<Pointwise>,
    ) -> Result<()>;
    /// LayerNorm of each row in place: `(x - mean) / sqrt(var + eps) * weight + bias`.
    fn layer_norm(
        &mut self,
        x: &mut Self::Act,
        weight: &Self::Vector,
        bias: &Self::Vector,
        eps: f32,
    ) -> Result<()>;
    /// The ranks this backend's model is split across, if it is.
    fn group(&self) -> Option<&Group> {
        None
    }
    /// This backend's share of its stage's tensor-parallel group.
    fn tensor_parallel(&self) -> TensorParallel {
        self.group().map_or(TensorParallel::ALONE, |g| g.tp)
    }
    /// This backend's pipeline stage.
    fn pipeline_stage(&self) -> PipelineStage {
        self.group().map_or(PipelineStage::ONLY, |g| g.pp)
    }
    /// `x` becomes the sum of every tensor-parallel rank's `x`.
    fn all_reduce(&mut self, _x: &mut Self::Act) -> Result<()> {
        bail!("{}: no tensor parallelism", self.describe())
    }
    /// Sends `x` (the residual stream) to the same tensor-parallel rank of the next stage.
    fn send_next(&mut self, _x: &Self::Act) -> Result<()> {
        bail!("{}: no pipeline parallelism", self.describe())
    }
    /// Receives `[rows, cols]` from the same tensor-parallel rank of the previous stage.
    fn recv_prev(&mut self, _x: &mut Self::Act, _rows: usize, _cols: usize) -> Result<()> {
        bail!("{}: no pipeline parallelism", self.describe())
    }
    /// The last [`Backend::logits`], `[rows, vocab]` on the host.
    fn host_logits(&mut self) -> Result<&mut [f32]>;
    /// Whether [`Backend::step`] takes `draws`.
    fn draws_on_device(&self) -> bool {
        false
    }
    /// The tokens the last [`Backend::step`] drew.
    fn drawn_tokens(&mut self) -> Result<Vec<u32>> {
        bail!("this backend samples on the host")
    }
    /// Backend, threads and weight format, for the start-up log line.
    fn describe(&self) -> String;
}
