//! GPU time by kernel, for tuning (`FERRITE_WGPU_PROFILE=1`, where the adapter has timestamp
//! queries inside passes): a timestamp before and after every launch, summed by kernel and by
//! the step's token count, logged every [`EVERY`] steps with the host's recording time. And
//! kernels left out of every step (`FERRITE_WGPU_SKIP=rms_norm,gated`): a step's time
//! without them is what they cost, which timestamps overstate (the outputs are then wrong);
//! the matrix-vector kernel's shape (`FERRITE_WGPU_GEMV=R,ROWS`: rows of w per subgroup, 1, 2
//! or 4, and per workgroup, a multiple of R).

use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::OnceLock;
use std::time::Duration;

/// `FERRITE_WGPU_GEMV`'s rows of w per subgroup and per workgroup, where it is set and valid.
pub fn gemv_shape() -> Option<(usize, usize)> {
    let v = std::env::var("FERRITE_WGPU_GEMV").ok()?;
    let (r, rows) = v.split_once(',')?;
    let (r, rows): (usize, usize) = (r.parse().ok()?, rows.parse().ok()?);
    let valid = [1, 2, 4].contains(&r) && rows > 0 && rows.is_multiple_of(r);
    if !valid {
        tracing::warn!("FERRITE_WGPU_GEMV={v}: R is 1, 2 or 4 and ROWS a multiple of R; ignored");
    }
    valid.then_some((r, rows))
}

/// Whether `FERRITE_WGPU_SKIP` names kernel `name`.
pub fn skipped(name: &str) -> bool {
    static SKIP: OnceLock<Vec<String>> = OnceLock::new();
    let skip = SKIP.get_or_init(|| {
        let names: Vec<String> = std::env::var("FERRITE_WGPU_SKIP")
            .unwrap_or_default()
            .split(',')
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        if !names.is_empty() {
            tracing::warn!("FERRITE_WGPU_SKIP: {names:?} left out of every step, outputs wrong");
        }
        names
    });
    skip.iter().any(|n| n == name)
}

/// Launches timed per step; later ones go untimed.
const LAUNCHES: u32 = 2048;
/// Steps between two reports.
const EVERY: usize = 64;

/// Sums over steps of one token count.
#[derive(Default)]
struct Totals {
    steps: u64,
    record: Duration,
    wall: Duration,
    /// By kernel: launches, nanoseconds.
    kernels: BTreeMap<&'static str, (u64, f64)>,
}

pub struct Profiler {
    queries: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    staging: wgpu::Buffer,
    /// The kernels launched so far in this step.
    names: Vec<&'static str>,
    period_ns: f64,
    by_tokens: BTreeMap<usize, Totals>,
    steps: usize,
}

/// The features profiling needs.
pub fn features() -> wgpu::Features {
    wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES
}

/// Whether the environment asks for profiling.
pub fn wanted() -> bool {
    std::env::var("FERRITE_WGPU_PROFILE").is_ok_and(|v| v != "0")
}

impl Profiler {
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> Self {
        let bytes = 2 * LAUNCHES as u64 * 8;
        let buffer = |label, usage| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        Self {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * LAUNCHES,
            }),
            resolve: buffer(
                "profile resolve",
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            ),
            staging: buffer(
                "profile read back",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            names: Vec::new(),
            period_ns: queue.get_timestamp_period() as f64,
            by_tokens: BTreeMap::new(),
            steps: 0,
        }
    }

    /// Times one launch: `dispatch` between two timestamps.
    pub fn around(
        &mut self,
        pass: &mut wgpu::ComputePass<'static>,
        name: &'static str,
        dispatch: impl FnOnce(&mut wgpu::ComputePass<'static>),
    ) {
        let i = self.names.len() as u32;
        if i >= LAUNCHES {
            return dispatch(pass);
        }
        self.names.push(name);
        pass.write_timestamp(&self.queries, 2 * i);
        dispatch(pass);
        pass.write_timestamp(&self.queries, 2 * i + 1);
    }

    /// Records the copy of this step's timestamps (after its pass ended).
    pub fn resolve(&self, encoder: &mut wgpu::CommandEncoder) {
        let n = 2 * self.names.len() as u32;
        if n > 0 {
            encoder.resolve_query_set(&self.queries, 0..n, &self.resolve, 0);
            encoder.copy_buffer_to_buffer(&self.resolve, 0, &self.staging, 0, n as u64 * 8);
        }
    }

    /// Adds the step just run (its commands submitted) to the sums; logs every [`EVERY`] steps.
    pub fn finish(
        &mut self,
        device: &wgpu::Device,
        tokens: usize,
        record: Duration,
        wall: Duration,
    ) -> Result<()> {
        let names = std::mem::take(&mut self.names);
        let totals = self.by_tokens.entry(tokens).or_default();
        totals.steps += 1;
        totals.record += record;
        totals.wall += wall;
        if !names.is_empty() {
            let (tx, rx) = std::sync::mpsc::channel();
            let bytes = 16 * names.len() as u64;
            self.staging
                .map_async(wgpu::MapMode::Read, ..bytes, move |r| {
                    let _ = tx.send(r);
                });
            device.poll(wgpu::PollType::wait_indefinitely())?;
            rx.recv().context("the profile never came back")??;
            {
                let view = self.staging.get_mapped_range(..bytes)?;
                let stamps: &[u64] = bytemuck::cast_slice(&view);
                for (name, pair) in names.iter().zip(stamps.chunks_exact(2)) {
                    let ns = pair[1].saturating_sub(pair[0]) as f64 * self.period_ns;
                    let k = totals.kernels.entry(name).or_default();
                    k.0 += 1;
                    k.1 += ns;
                }
            }
            self.staging.unmap();
        }
        self.steps += 1;
        if self.steps.is_multiple_of(EVERY) {
            tracing::info!("GPU time by kernel:\n{}", self.report());
        }
        Ok(())
    }

    /// Per step of each token count: wall and recording time, then each kernel's share.
    fn report(&self) -> String {
        let mut out = String::new();
        for (tokens, t) in &self.by_tokens {
            let per = |d: Duration| d.as_secs_f64() * 1e3 / t.steps as f64;
            let gpu: f64 = t.kernels.values().map(|k| k.1).sum::<f64>() / 1e6 / t.steps as f64;
            let _ = writeln!(
                out,
                "{tokens} tokens x {} steps: {:.3} ms a step, {:.3} recording, {gpu:.3} in kernels",
                t.steps,
                per(t.wall),
                per(t.record)
            );
            let mut kernels: Vec<_> = t.kernels.iter().collect();
            kernels.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
            for (name, (n, ns)) in kernels {
                let _ = writeln!(
                    out,
                    "  {name:<14} {:>8.1} us a step  {:>6.1} launches  {:>7.2} us each",
                    ns / 1e3 / t.steps as f64,
                    *n as f64 / t.steps as f64,
                    ns / 1e3 / *n as f64
                );
            }
        }
        out
    }
}
