//! What every table shares: the steps it builds, medians of synchronized runs.

use anyhow::Result;
use candle_core::Device;
use ferrite_model::step::PackedStep;
use std::time::Instant;

/// Block size of every step the benchmark builds.
pub(super) const BLOCK: usize = 16;

/// Median seconds of `f` over `n` runs after two warm-up runs; `f` must end synchronized.
pub(super) fn median(n: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    f()?;
    let mut t = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[n / 2])
}

/// Waits for the device's work.
pub(super) fn sync(dev: &Device) -> Result<()> {
    if let Device::Cuda(d) = dev {
        d.cuda_stream().synchronize()?;
    }
    Ok(())
}

/// `batch` requests of `qlen` new tokens each, at K/V length `ctx`, in disjoint blocks; a
/// logits row for the last `rows` tokens of each.
pub(super) fn step_rows(batch: usize, qlen: usize, ctx: usize, rows: usize) -> PackedStep {
    let per = ctx.div_ceil(BLOCK);
    let mut s = PackedStep::default();
    for b in 0..batch {
        let table: Vec<u32> = (0..per).map(|i| (b * per + i) as u32).collect();
        let ids: Vec<u32> = (0..qlen).map(|i| (1000 + 7 * i + b) as u32).collect();
        s.push(&ids, ctx - qlen, std::slice::from_ref(&table), BLOCK);
        let end = s.num_tokens() as u32;
        s.logits_indices.extend(end - rows as u32..end);
        s.state.slots.push(b as u32);
    }
    s.finish();
    s
}

/// `batch` requests of `qlen` new tokens each, a logits row for the last.
pub(super) fn step(batch: usize, qlen: usize, ctx: usize) -> PackedStep {
    step_rows(batch, qlen, ctx, 1)
}
