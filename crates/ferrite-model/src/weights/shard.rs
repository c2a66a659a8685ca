//! A rank's slice of a matrix, cut from its stored blocks: whole rows (column-parallel
//! layers, vocabulary shards) or whole blocks of every row (row-parallel layers), so a
//! shard multiplies exactly as the same rows or columns of the whole matrix would.

use anyhow::{bail, Result};
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use std::ops::Range;

/// Which part of a `[rows, cols]` matrix a rank holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Take {
    All,
    /// These rows; rows past the matrix's end are zeros (a vocabulary padded to equal shards).
    Rows(Range<usize>),
    Cols(Range<usize>),
}

impl Take {
    /// The shape of the part taken from `[rows, cols]`.
    pub fn dims(&self, rows: usize, cols: usize) -> (usize, usize) {
        match self {
            Take::All => (rows, cols),
            Take::Rows(r) => (r.len(), cols),
            Take::Cols(c) => (rows, c.len()),
        }
    }

    pub fn apply(&self, t: QTensor) -> Result<QTensor> {
        match self {
            Take::All => Ok(t),
            Take::Rows(r) => rows(t, r.clone()),
            Take::Cols(c) => cols(t, c.clone()),
        }
    }
}

fn row_bytes(dtype: GgmlDType, cols: usize) -> usize {
    cols / dtype.block_size() * dtype.type_size()
}

/// Rows `range` of `t`; past its end, zero bytes (a zero block is zero in every format).
pub fn rows(t: QTensor, range: Range<usize>) -> Result<QTensor> {
    let (n, c) = t.shape().dims2()?;
    if range == (0..n) {
        return Ok(t);
    }
    let (dtype, data) = (t.dtype(), t.data()?);
    let rb = row_bytes(dtype, c);
    let mut out = vec![0u8; range.len() * rb];
    let have = range.start.min(n)..range.end.min(n);
    out[..have.len() * rb].copy_from_slice(&data[have.start * rb..have.end * rb]);
    Ok(qtensor_from_ggml(
        dtype,
        &out,
        vec![range.len(), c],
        &Device::Cpu,
    )?)
}

/// Columns `range` of every row of `t`: its blocks as stored when the range falls on block
/// boundaries; else refused (a requantized slice would not be the same weights).
pub fn cols(t: QTensor, range: Range<usize>) -> Result<QTensor> {
    let (n, c) = t.shape().dims2()?;
    if range == (0..c) {
        return Ok(t);
    }
    let (dtype, data) = (t.dtype(), t.data()?);
    let bs = dtype.block_size();
    if !range.start.is_multiple_of(bs) || !range.len().is_multiple_of(bs) || range.end > c {
        bail!(
            "columns {range:?} of a [{n}, {c}] {dtype:?} matrix do not fall on its blocks of {bs}"
        );
    }
    let (rb, ts) = (row_bytes(dtype, c), dtype.type_size());
    let (from, len) = (range.start / bs * ts, range.len() / bs * ts);
    let mut out = Vec::with_capacity(n * len);
    for row in data.chunks(rb) {
        out.extend_from_slice(&row[from..from + len]);
    }
    Ok(qtensor_from_ggml(
        dtype,
        &out,
        vec![n, range.len()],
        &Device::Cpu,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    fn dense(t: &QTensor) -> Vec<Vec<f32>> {
        t.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap()
    }

    #[test]
    fn slices_hold_the_same_weights_as_the_whole() {
        let t = Tensor::randn(0f32, 1.0, (6, 512), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::F32] {
            let q = || QTensor::quantize(&t, dtype).unwrap();
            let whole = dense(&q());
            let r = dense(&rows(q(), 2..8).unwrap());
            assert_eq!(r[..4], whole[2..6]);
            assert!(
                r[4..].iter().flatten().all(|&v| v == 0.0),
                "{dtype:?} padding"
            );
            let c = dense(&cols(q(), 256..512).unwrap());
            for (got, want) in c.iter().zip(&whole) {
                assert_eq!(got[..], want[256..]);
            }
            let off_blocks = cols(q(), 32..64);
            assert_eq!(off_blocks.is_err(), dtype.block_size() > 32, "{dtype:?}");
        }
    }
}
