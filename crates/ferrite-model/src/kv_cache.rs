//! The paged KV cache: one K and one V buffer per layer in f16 (half the bytes decode reads,
//! twice the tokens per GiB), allocated once at start-up and never resized. A block keeps each
//! KV head's slice contiguous: V `[num_blocks, kv_heads, block_size, head_dim]`, K transposed
//! `[num_blocks, kv_heads, head_dim, block_size]` so attention reads a block's keys for one
//! dimension as one vector.

use half::f16;

use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl CacheShape {
    /// Elements of one token's K (or V) row.
    pub fn row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    pub fn elems_per_layer(&self) -> usize {
        self.num_blocks * self.block_size * self.row()
    }
}

pub struct LayerCache {
    pub k: Vec<f16>,
    pub v: Vec<f16>,
}

pub struct KvCache {
    pub shape: CacheShape,
    pub layers: Vec<LayerCache>,
}

impl KvCache {
    pub fn new(shape: CacheShape, num_layers: usize) -> Self {
        let n = shape.elems_per_layer();
        let layers = (0..num_layers)
            .map(|_| LayerCache {
                k: vec![f16::ZERO; n],
                v: vec![f16::ZERO; n],
            })
            .collect();
        Self { shape, layers }
    }

    pub fn bytes_per_block(shape_block: usize, row: usize, num_layers: usize) -> usize {
        2 * num_layers * shape_block * row * std::mem::size_of::<f16>()
    }
}

/// Writes each new token's K/V row (`[T, kv_heads * head_dim]`) into its slot.
pub fn write_kv(
    layer: &mut LayerCache,
    k: &[f32],
    v: &[f32],
    slot_mapping: &[u32],
    shape: &CacheShape,
) {
    let (kc, vc) = (&mut layer.k, &mut layer.v);
    let (row, d, bs) = (shape.row(), shape.head_dim, shape.block_size);
    for ((k, v), &slot) in k
        .chunks_exact(row)
        .zip(v.chunks_exact(row))
        .zip(slot_mapping)
    {
        let (blk, j) = (slot as usize / bs, slot as usize % bs);
        for (h, (k, v)) in k.chunks_exact(d).zip(v.chunks_exact(d)).enumerate() {
            let head = (blk * shape.num_kv_heads + h) * d * bs;
            for (dd, &x) in k.iter().enumerate() {
                kc[head + dd * bs + j] = f16::from_f32(x);
            }
            vc[head + j * d..][..d].convert_from_f32_slice(v);
        }
    }
}

/// Zeroes nothing and touches every page, so the pool's memory is resident from the start
/// and RSS does not grow with load.
pub fn prefault(cache: &mut KvCache) {
    cache.layers.par_iter_mut().for_each(|l| {
        for buf in [&mut l.k, &mut l.v] {
            for chunk in buf.chunks_mut(1024) {
                chunk[0] = f16::ZERO;
            }
        }
    });
}
