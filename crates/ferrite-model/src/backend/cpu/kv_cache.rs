//! The paged KV cache: one K and one V buffer per layer in f16 (half the bytes decode reads,
//! twice the tokens per GiB), allocated once at start-up and never resized. A block keeps each
//! KV head's slice contiguous: V `[num_blocks, kv_heads, block_size, head_dim]`, K transposed
//! `[num_blocks, kv_heads, head_dim, block_size]` so attention reads a block's keys for one
//! dimension as one vector.

use half::f16;

use half::slice::HalfFloatSliceExt;

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
}

/// One layer's K and V pages (the layout above), allocated once at start-up.
pub struct LayerCache {
    pub k: Vec<f16>,
    pub v: Vec<f16>,
    pub shape: CacheShape,
}

/// Bytes of one block across `num_layers` layers of `row` K (and V) elements per token.
pub fn bytes_per_block(block_size: usize, row: usize, num_layers: usize) -> usize {
    2 * num_layers * block_size * row * std::mem::size_of::<f16>()
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
