//! What the CPU attention's pieces share: where the step's queries and keys are, the work
//! items of one call and the buffers they reuse.

use crate::backend::cpu::kv_cache::Pages;
use crate::backend::cpu::quant::isa::Isa;

/// Where each request's queries and keys are, in the packed step.
pub struct AttentionMeta<'a> {
    /// `[B + 1]`: request `b` owns query rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]`.
    pub cu_seqlens_q: &'a [u32],
    /// `[B]`: K/V length of each request including this step's tokens.
    pub seq_lens_k: &'a [u32],
    /// `[B, max_blocks]`, row-major.
    pub block_tables: &'a [u32],
    pub max_blocks: usize,
    pub block_size: usize,
}

pub struct AttentionParams<'a> {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub sliding_window: Option<usize>,
    pub softcap: Option<f32>,
    /// False: every query row sees all of its request's keys (encoders).
    pub causal: bool,
    /// Attention sinks: per query head, a logit in every row's softmax that no value follows
    /// (gpt-oss); `[num_heads]`.
    pub sinks: Option<&'a [f32]>,
}

/// Up to Q_TILE query rows of request `b`, KV head `kvh`, keys `keys` (one chunk, clipped
/// to the tile's range); its partials live at `part` in the step's buffer: `acc` `[rows,
/// group, head_dim]`, then `m` and `l` `[rows, group]` each.
pub(super) struct Item {
    pub(super) b: usize,
    pub(super) rows: std::ops::Range<usize>,
    pub(super) kvh: usize,
    pub(super) keys: std::ops::Range<usize>,
    pub(super) part: usize,
}

/// What every item of one call reads: the queries, the layer's caches, the step's layout.
#[derive(Clone, Copy)]
pub(super) struct LayerInputs<'a> {
    /// The kernel set (the caches are widened through it too).
    pub(super) isa: Isa,
    pub(super) q: &'a [f32],
    pub(super) k_cache: &'a Pages,
    pub(super) v_cache: &'a Pages,
    pub(super) meta: &'a AttentionMeta<'a>,
    pub(super) p: &'a AttentionParams<'a>,
}

/// The items (consecutive) whose partials make up the output of one tile and KV head.
pub(super) struct Merge {
    pub(super) rows: std::ops::Range<usize>,
    pub(super) kvh: usize,
    pub(super) items: std::ops::Range<usize>,
}

/// The calling thread's work list and partials, reused across layers and steps.
#[derive(Default)]
pub(super) struct StepWork {
    pub(super) items: Vec<Item>,
    pub(super) merges: Vec<Merge>,
    pub(super) parts: Vec<f32>,
}

/// A compute thread's buffers for one item, reused across items, layers and steps.
#[derive(Default)]
pub(super) struct TileScratch {
    /// The chunk in f32: K^T `[head_dim, keys]`, V `[keys, head_dim]`.
    pub(super) kt: Vec<f32>,
    pub(super) vb: Vec<f32>,
    /// One row's scores, then its weights, `[heads, keys]`.
    pub(super) w: Vec<f32>,
    /// One block's K `[head_dim, block_size]` before it is cut into pieces (block sizes
    /// other than LANES).
    pub(super) blk: Vec<f32>,
}

/// A group of a tile's rows whose query vectors (each row's heads of one KV head) meet the same
/// K^T pieces: `q` starts at the first row's first head, rows `row_stride` apart, heads `d`
/// apart; scores go to `out[(row * heads + head) * cols + piece * LANES + lane]`.
pub(super) struct ScoreBlock<'a> {
    pub(super) q: &'a [f32],
    pub(super) row_stride: usize,
    pub(super) rows: usize,
    pub(super) heads: usize,
    pub(super) d: usize,
    pub(super) cols: usize,
}

impl ScoreBlock<'_> {
    /// Query vector `v` (row-major over rows and heads) and where its scores start.
    pub(super) fn vector(&self, v: usize) -> (usize, usize) {
        let (row, head) = (v / self.heads, v % self.heads);
        (row * self.row_stride + head * self.d, v * self.cols)
    }
}

/// The key range `[first, end)` of each query row of request `b`: causal, or all of them.
pub(super) fn row_span<'a>(
    meta: &'a AttentionMeta,
    p: &'a AttentionParams,
    b: usize,
) -> impl Fn(usize) -> std::ops::Range<usize> + 'a {
    let q_start = meta.cu_seqlens_q[b] as usize;
    let q_len = meta.cu_seqlens_q[b + 1] as usize - q_start;
    let k_len = meta.seq_lens_k[b] as usize;
    move |t| {
        if !p.causal {
            return 0..k_len;
        }
        let pos = k_len - q_len + (t - q_start);
        p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w))..pos + 1
    }
}
