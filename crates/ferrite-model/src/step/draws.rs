//! Tokens drawn on the device: how each logits row draws, and the grammar masks.

/// The tokens of a step drawn on the device: how each row draws, and the grammar masks
/// (`None`: no row has a grammar).
#[derive(Clone, Copy)]
pub struct DeviceDraws<'a> {
    pub rows: &'a [RowDraw],
    pub masks: Option<Masks<'a>>,
}

/// A step's grammar masks: which rows have one, and how to write them.
#[derive(Clone, Copy)]
pub struct Masks<'a> {
    pub rows: &'a [bool],
    /// Writes each masked row's mask into `out` (`[rows, words]` u32, bit `t % 32` of word
    /// `t / 32`); a device calls it while its forward pass runs.
    pub fill: &'a (dyn Fn(&mut [u32], usize) + Sync),
}

/// How one logits row becomes a token on the device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RowDraw {
    Greedy,
    /// From softmax(logits / temperature) cut as the CPU sampler cuts it (top-k, top-p,
    /// min-p; `top_k` 0 and `top_p` 1 are off); `key` fixes the row's noise (from the
    /// request's seed and token index, or from the engine's RNG).
    Sample {
        temperature: f32,
        top_k: u32,
        top_p: f32,
        min_p: f32,
        key: u64,
    },
}
