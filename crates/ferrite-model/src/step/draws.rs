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

/// u32 parameters per row of the device's draw kernels (CUDA's `sample_rows`, wgpu's
/// sample.wgsl).
pub const DRAW_PARAMS: usize = 7;

/// u32 words of a grammar mask over `vocab` tokens.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// The draw kernels' parameters: per row temperature, min-p and top-p as f32 bits, top-k, the
/// 64-bit key and whether the row is masked (`masked`, one flag per row or none); greedy
/// rows are all zeros. Padded with greedy rows up to `rows`.
pub fn draw_params(draws: &[RowDraw], rows: usize, masked: &[bool]) -> Vec<u32> {
    let mut p = vec![0u32; DRAW_PARAMS * rows.max(draws.len())];
    for (out, &m) in p.chunks_mut(DRAW_PARAMS).zip(masked) {
        out[DRAW_PARAMS - 1] = m as u32;
    }
    for (d, out) in draws.iter().zip(p.chunks_mut(DRAW_PARAMS)) {
        if let RowDraw::Sample {
            temperature,
            top_k,
            top_p,
            min_p,
            key,
        } = *d
        {
            out[..DRAW_PARAMS - 1].copy_from_slice(&[
                temperature.to_bits(),
                min_p.to_bits(),
                top_p.to_bits(),
                top_k,
                key as u32,
                (key >> 32) as u32,
            ]);
        }
    }
    p
}
