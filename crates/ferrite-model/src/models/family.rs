//! What a family gives the decoder: its weights and forward over the packed step
//! ([`Family`]), and the activations a step reuses ([`Buffers`]).

use crate::backend::{Backend, GdnSpec, MoeBytes, Step};
use anyhow::{bail, Result};

/// A family's weights and its forward over the packed step.
pub trait Family<B: Backend>: Send + Sync {
    /// Runs every layer and leaves the `logits_indices` rows' logits in the backend;
    /// `states`: one per linear-attention layer ([`Family::state_layers`]).
    fn forward(
        &self,
        b: &mut B,
        s: &Step<B>,
        cache: &mut [B::LayerCache],
        states: &mut [B::StateCache],
        ws: &mut Buffers<B>,
    ) -> Result<()>;

    /// The multi-token-prediction head over `s`, right after [`Family::forward`] (or, when
    /// `chained`, after the head's own last step): row `i` holds the token one past the
    /// position of row `hidden.rows[i]` of that step, whose residual stream `ws.x` still
    /// holds; leaves the logits of the token after that as `forward` leaves its own.
    fn mtp(
        &self,
        _b: &mut B,
        _s: &Step<B>,
        _cache: &mut [B::LayerCache],
        _ws: &mut Buffers<B>,
        _chained: bool,
    ) -> Result<()> {
        bail!("this model family has no multi-token-prediction head")
    }

    /// Whether [`Family::mtp`] runs: the family has a head and the checkpoint its weights.
    fn has_mtp(&self) -> bool {
        false
    }

    /// The linear-attention layers, in order: each keeps a recurrent state per request.
    fn state_layers(&self) -> Vec<GdnSpec> {
        Vec::new()
    }

    /// Bytes the weights occupy on the device.
    fn weight_bytes(&self, b: &B) -> usize;

    /// The mixture-of-experts layers' share of the weights (none for a dense family).
    fn expert_bytes(&self, _b: &B) -> MoeBytes {
        MoeBytes::default()
    }
}

/// Activations of one step, reused across steps.
pub struct Buffers<B: Backend> {
    /// The residual stream `[T, hidden]`.
    pub x: B::Act,
    pub tmp: Scratch<B>,
}

/// What a layer computes on the way (kept apart from `x` so both can be borrowed at once).
pub struct Scratch<B: Backend> {
    pub qkv: B::Act,
    pub q: B::Act,
    /// Attention output: the input of the output projection.
    pub attn: B::Act,
    /// The gated MLP activation: the input of the down projection.
    pub act: B::Act,
    /// An attention output's gate (Qwen3.5).
    pub gate: B::Act,
}

impl<B: Backend> Default for Buffers<B> {
    fn default() -> Self {
        Self {
            x: B::Act::default(),
            tmp: Scratch {
                qkv: B::Act::default(),
                q: B::Act::default(),
                attn: B::Act::default(),
                act: B::Act::default(),
                gate: B::Act::default(),
            },
        }
    }
}

/// After a step, on a backend that does not reuse its activations: drops them, but for the
/// residual stream when `keep_x` (an MTP head reads it next).
pub(super) fn drop_activations<B: Backend>(ws: &mut Buffers<B>, keep_x: bool) {
    if !B::REUSES_ACTIVATIONS {
        let x = std::mem::take(&mut ws.x);
        *ws = Buffers::default();
        if keep_x {
            ws.x = x;
        }
    }
}

/// Bytes of one request's recurrent state over `layers` (f32).
pub fn state_bytes(layers: &[GdnSpec]) -> usize {
    layers.iter().map(|s| s.state_elems() * 4).sum()
}
