//! Buffers on the GPU: activations (f32, grown to the largest step and reused), small
//! vectors, and reading results back.

use super::device::Gpu;
use anyhow::{bail, Context, Result};
use wgpu::util::DeviceExt;

const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// Activations `[rows, cols]` f32. The buffer is kept across steps and replaced by a larger
/// one when a step needs more (commands already recorded keep the old one alive).
#[derive(Default)]
pub struct Act {
    buf: Option<wgpu::Buffer>,
    pub rows: usize,
    pub cols: usize,
}

impl Act {
    pub fn buf(&self) -> Result<&wgpu::Buffer> {
        self.buf
            .as_ref()
            .context("activation read before it was written")
    }

    /// Sized for `[rows, cols]`, its contents undefined.
    pub fn shape(&mut self, gpu: &Gpu, rows: usize, cols: usize) -> Result<&wgpu::Buffer> {
        let bytes = (4 * rows * cols).max(16) as u64;
        if bytes > gpu.limits.max_storage_buffer_binding_size {
            bail!(
                "activations of {rows} x {cols} take {} MiB, past the {} MiB one binding of {} may hold: lower --max-num-batched-tokens",
                bytes >> 20,
                gpu.limits.max_storage_buffer_binding_size >> 20,
                gpu.info.name
            );
        }
        if self.buf.as_ref().is_none_or(|b| b.size() < bytes) {
            let old = self.buf.as_ref().map_or(0, |b| b.size());
            gpu.count_activations(bytes.next_multiple_of(256), old);
            self.buf = Some(gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("activations"),
                size: bytes.next_multiple_of(256),
                usage: STORAGE,
                mapped_at_creation: false,
            }));
        }
        (self.rows, self.cols) = (rows, cols);
        self.buf()
    }

    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A small f32 vector: norm weights, biases, sinks.
pub struct Vector {
    pub buf: wgpu::Buffer,
    pub len: usize,
}

/// A storage buffer holding `words` (at least one: no binding may be empty).
pub fn upload_words(gpu: &Gpu, label: &str, words: &[u32]) -> wgpu::Buffer {
    let contents: &[u8] = match words.is_empty() {
        true => &[0; 4],
        false => bytemuck::cast_slice(words),
    };
    gpu.device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents,
            usage: STORAGE,
        })
}

pub fn upload_f32(gpu: &Gpu, label: &str, v: &[f32]) -> wgpu::Buffer {
    upload_words(gpu, label, bytemuck::cast_slice(v))
}

/// A zeroed buffer of `bytes`.
pub fn zeros(gpu: &Gpu, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
    if bytes > gpu.limits.max_storage_buffer_binding_size {
        bail!(
            "{label} of {} MiB: past the {} MiB one binding of {} may hold",
            bytes >> 20,
            gpu.limits.max_storage_buffer_binding_size >> 20,
            gpu.info.name
        );
    }
    Ok(gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: bytes.max(16).next_multiple_of(4),
        usage: STORAGE,
        mapped_at_creation: false,
    }))
}

/// `words` written into `kept` (replaced by a larger buffer when they do not fit): a buffer
/// bound the same way every step keeps its bind groups.
pub fn write_kept(
    gpu: &Gpu,
    label: &str,
    kept: &mut Option<wgpu::Buffer>,
    words: &[u32],
) -> Result<wgpu::Buffer> {
    let bytes = (4 * words.len() as u64).max(4);
    let buf = match kept {
        Some(b) if b.size() >= bytes => b.clone(),
        _ => kept
            .insert(zeros(gpu, label, bytes.next_power_of_two())?)
            .clone(),
    };
    gpu.queue.write_buffer(&buf, 0, bytemuck::cast_slice(words));
    Ok(buf)
}

/// f32 values as f16 packed two to a word (a row of odd length padded with a zero).
pub fn f16_words(values: &[f32], cols: usize) -> Vec<u32> {
    let words = cols.div_ceil(2);
    let mut out = Vec::with_capacity(values.len() / cols.max(1) * words);
    for row in values.chunks(cols) {
        for pair in row.chunks(2) {
            let lo = half::f16::from_f32(pair[0]).to_bits() as u32;
            let hi = pair
                .get(1)
                .map_or(0, |&v| half::f16::from_f32(v).to_bits() as u32);
            out.push(lo | (hi << 16));
        }
    }
    out
}

/// Copies `bytes` of `src` to the host once everything submitted before has run: the one wait
/// of a step.
pub fn read_back(
    gpu: &Gpu,
    mut encoder: wgpu::CommandEncoder,
    src: &wgpu::Buffer,
    bytes: u64,
) -> Result<Vec<f32>> {
    let bytes = bytes.next_multiple_of(4).max(4);
    let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("read back"),
        size: bytes,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    encoder.copy_buffer_to_buffer(src, 0, &staging, 0, bytes);
    gpu.queue.submit([encoder.finish()]);
    let (tx, rx) = std::sync::mpsc::channel();
    staging.map_async(wgpu::MapMode::Read, .., move |r| {
        let _ = tx.send(r);
    });
    gpu.device
        .poll(wgpu::PollType::wait_indefinitely())
        .context("waiting for the GPU")?;
    gpu.take_error()?;
    rx.recv()
        .context("the read-back never finished")?
        .context("mapping the read-back buffer")?;
    let out = {
        let view = staging
            .get_mapped_range(..)
            .context("reading the read-back buffer")?;
        bytemuck::cast_slice::<u8, f32>(&view).to_vec()
    };
    staging.unmap();
    Ok(out)
}
