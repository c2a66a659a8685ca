//! GGUF blocks in the layout the kernels read (`FMT` in weights.wgsl): blocks of 32 values,
//! all codes of a part first (a block's in whole 16-byte vectors), then each block's scale
//! words. Q8_0, Q4_0 and Q4_1 keep their bytes; the K-quants' super-blocks of 256 values are
//! cut into blocks of 32 with f32 scales (a 6-bit scale times the f16 super-block scale is
//! exact in f32): Q4_K as nibbles with a scale and min, Q5_K as bytes with a scale and min,
//! Q6_K as signed bytes with a scale per 16 values. The codes come from candle's
//! dequantization (value = code x scale + min, recovered exactly), the scales from the
//! super-block's bytes.

use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

/// How a matrix's rows are stored (`FMT` in weights.wgsl: the enum's order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4K,
    Q5K,
    Q6K,
}

impl Format {
    /// A GGUF type's storage here: blocks where the kernels read them, else f16.
    pub fn of(dtype: GgmlDType) -> Self {
        match dtype {
            GgmlDType::Q8_0 => Self::Q8_0,
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            GgmlDType::Q4K => Self::Q4K,
            GgmlDType::Q5K => Self::Q5K,
            GgmlDType::Q6K => Self::Q6K,
            _ => Self::F16,
        }
    }

    /// Words of a row of `cols` values (codes and scales).
    pub fn row_words(self, cols: usize) -> usize {
        match self {
            Self::F16 => cols.div_ceil(2),
            _ => cols / 32 * (self.code_words() + self.scale_words()),
        }
    }

    /// Words of a block's codes.
    pub fn code_words(self) -> usize {
        match self {
            Self::F16 => 0,
            Self::Q8_0 | Self::Q5K | Self::Q6K => 8,
            Self::Q4_0 | Self::Q4_1 | Self::Q4K => 4,
        }
    }

    /// Words of a block's scales: GGUF's f16 scale (and min) in one, or two f32s.
    pub fn scale_words(self) -> usize {
        match self {
            Self::F16 => 0,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 => 1,
            Self::Q4K | Self::Q5K | Self::Q6K => 2,
        }
    }
}

/// Quantized rows as the kernels read them: every block's codes, then its scale words, both
/// in row order.
pub struct Blocks {
    pub codes: Vec<u32>,
    pub scales: Vec<u32>,
}

/// `t`'s blocks in `format` (one of the quantized ones).
pub fn repack(format: Format, t: &QTensor) -> Result<Blocks> {
    let bytes = t.data()?;
    match format {
        Format::Q8_0 | Format::Q4_0 | Format::Q4_1 => Ok(repack_legacy(format, &bytes)),
        Format::Q4K | Format::Q5K | Format::Q6K => {
            let values = t
                .dequantize(&Device::Cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            Ok(repack_k(format, &bytes, &values))
        }
        Format::F16 => bail!("f16 rows have no blocks"),
    }
}

fn word(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Q8_0, Q4_0, Q4_1: the f16 scale (and min) to a word, the codes as they are.
fn repack_legacy(format: Format, bytes: &[u8]) -> Blocks {
    let (head, size) = match format {
        Format::Q8_0 => (2, 34),
        Format::Q4_0 => (2, 18),
        _ => (4, 20),
    };
    let mut out = Blocks {
        codes: Vec::with_capacity(bytes.len() / 4),
        scales: Vec::with_capacity(bytes.len() / size),
    };
    for block in bytes.chunks_exact(size) {
        let mut scales = [0u8; 4];
        scales[..head].copy_from_slice(&block[..head]);
        out.scales.push(u32::from_le_bytes(scales));
        out.codes.extend(block[head..].chunks_exact(4).map(word));
    }
    out
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K and Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes.
fn scale_min(s: &[u8], j: usize) -> (f32, f32) {
    let (sc, m) = match j < 4 {
        true => (s[j] & 63, s[j + 4] & 63),
        false => (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        ),
    };
    (sc as f32, m as f32)
}

/// The K-quants' super-blocks as blocks of 32: per block two f32 words (scale and min, or
/// Q6_K's two scales of 16 values) and codes recovered from `values`.
fn repack_k(format: Format, bytes: &[u8], values: &[f32]) -> Blocks {
    let size = match format {
        Format::Q4K => 144,
        Format::Q5K => 176,
        _ => 210,
    };
    let mut out = Blocks {
        codes: Vec::with_capacity(values.len() / 4),
        scales: Vec::with_capacity(values.len() / 16),
    };
    for (sb, v) in bytes.chunks_exact(size).zip(values.chunks_exact(256)) {
        for (j, v) in v.chunks_exact(32).enumerate() {
            // value = code * scale[half] + min.
            let (scale, min) = match format {
                Format::Q6K => {
                    let d = f16_at(sb, 208);
                    let sc = |i: usize| sb[192 + i] as i8 as f32 * d;
                    ([sc(2 * j), sc(2 * j + 1)], 0.0)
                }
                _ => {
                    let (sc, m) = scale_min(&sb[4..16], j);
                    let d = f16_at(sb, 0) * sc;
                    ([d, d], -(f16_at(sb, 2) * m))
                }
            };
            let code = |i: usize| {
                let s = scale[i / 16];
                if s == 0.0 {
                    return 0;
                }
                ((v[i] - min) / s).round() as i32
            };
            match format {
                // Nibbles as Q4_0 packs them: byte i holds values i and i + 16.
                Format::Q4K => out.codes.extend((0..4).map(|w| {
                    let byte = |i: usize| (code(i) as u32 & 15) | (code(i + 16) as u32 & 15) << 4;
                    (0..4).fold(0, |acc, b| acc | byte(4 * w + b) << (8 * b))
                })),
                _ => out.codes.extend((0..8).map(|w| {
                    let byte = |i: usize| code(i) as u8 as u32;
                    (0..4).fold(0, |acc, b| acc | byte(4 * w + b) << (8 * b))
                })),
            }
            match format {
                Format::Q6K => out.scales.extend(scale.map(f32::to_bits)),
                _ => out.scales.extend([scale[0].to_bits(), min.to_bits()]),
            }
        }
    }
    out
}
