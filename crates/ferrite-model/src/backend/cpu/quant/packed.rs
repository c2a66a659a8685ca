//! Weights repacked once at load into the layout the kernels read.
//!
//! Every block of 32 weights becomes one of two forms:
//! - `U4`: 4-bit codes with `w = d * code + m` (Q4_0, Q4_1, Q4_K exactly). Two neighbouring
//!   blocks share 32 bytes: byte `j` holds code `j` of the even block in its low nibble and
//!   code `j` of the odd block in its high nibble, so one 32-byte load unpacks into two whole
//!   blocks with an `and` and a shift.
//! - `U8`: 8-bit codes with `w = d * (code - 128)` (Q8_0, Q5_0 exactly; other types are
//!   dequantized and re-quantized to 8 bits per block of 32).
//!
//! Rows hold an even number of blocks (a zero block pads odd widths), rows are contiguous.

use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use half::f16;
use rayon::prelude::*;

pub const BLOCK: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codes {
    U4,
    U8,
}

impl Codes {
    /// The form a GGML block type is repacked into; `None` for float types.
    pub fn of(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => None,
            GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q4K => Some(Codes::U4),
            _ => Some(Codes::U8),
        }
    }
}

pub struct PackedWeight {
    pub rows: usize,
    pub cols: usize,
    /// Blocks per row, padded to even.
    pub blocks: usize,
    pub codes: Codes,
    /// Row-major codes: `blocks * 16` bytes per row for `U4`, `blocks * 32` for `U8`.
    pub data: Vec<u8>,
    /// Per-block scale, `[rows, blocks]`; f16 like GGML's, to keep decode's bytes down.
    pub d: Vec<f16>,
    /// Per-block offset, `[rows, blocks]`, `U4` only.
    pub m: Vec<f16>,
}

/// One decoded block: `w = d * code + m` for `U4`, `w = d * (code - 128)` for `U8`.
/// Scales are stored as f16: exact for every type but Q4_K, whose sub-block scale products
/// round to f16 (relative error at most 2^-11).
#[derive(Clone, Copy)]
struct Block {
    codes: [u8; BLOCK],
    d: f32,
    m: f32,
}

const ZERO_U4: Block = Block {
    codes: [0; BLOCK],
    d: 0.0,
    m: 0.0,
};
const ZERO_U8: Block = Block {
    codes: [128; BLOCK],
    d: 0.0,
    m: 0.0,
};

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// GGML's 4-bit layout: byte `j` holds element `j` (low nibble) and `j + 16` (high).
fn nibbles(qs: &[u8]) -> [u8; BLOCK] {
    let mut c = [0u8; BLOCK];
    for j in 0..16 {
        c[j] = qs[j] & 0x0F;
        c[j + 16] = qs[j] >> 4;
    }
    c
}

/// Q4_K's 6-bit scale and min of sub-block `j`.
fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Decodes one row of raw GGML blocks whose codes the kernels can use as they are.
fn decode_row(dtype: GgmlDType, raw: &[u8], out: &mut Vec<Block>) {
    match dtype {
        GgmlDType::Q4_0 => out.extend(raw.chunks_exact(18).map(|b| {
            let d = f16_at(b, 0);
            Block {
                codes: nibbles(&b[2..]),
                d,
                m: -8.0 * d,
            }
        })),
        GgmlDType::Q4_1 => out.extend(raw.chunks_exact(20).map(|b| Block {
            codes: nibbles(&b[4..]),
            d: f16_at(b, 0),
            m: f16_at(b, 2),
        })),
        GgmlDType::Q8_0 => out.extend(raw.chunks_exact(34).map(|b| {
            let mut codes = [0u8; BLOCK];
            for (c, &q) in codes.iter_mut().zip(&b[2..]) {
                *c = q ^ 0x80; // i8 -> i8 + 128
            }
            Block {
                codes,
                d: f16_at(b, 0),
                m: 0.0,
            }
        })),
        GgmlDType::Q5_0 => out.extend(raw.chunks_exact(22).map(|b| {
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let lo = nibbles(&b[6..]);
            let mut codes = [0u8; BLOCK];
            for (j, c) in codes.iter_mut().enumerate() {
                let q = lo[j] | (((qh >> j) & 1) as u8) << 4;
                *c = q + 112; // (q - 16) + 128
            }
            Block {
                codes,
                d: f16_at(b, 0),
                m: 0.0,
            }
        })),
        GgmlDType::Q4K => {
            for b in raw.chunks_exact(144) {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                let (scales, qs) = (&b[4..16], &b[16..]);
                for g in 0..4 {
                    let q = &qs[g * 32..][..32];
                    for (half, shift) in [(0, 0), (1, 4)] {
                        let (sc, mn) = q4k_scale_min(2 * g + half, scales);
                        let mut codes = [0u8; BLOCK];
                        for (c, &byte) in codes.iter_mut().zip(q) {
                            *c = (byte >> shift) & 0x0F;
                        }
                        out.push(Block {
                            codes,
                            d: d * sc as f32,
                            m: -(dmin * mn as f32),
                        });
                    }
                }
            }
        }
        _ => unreachable!("decode_row called for {dtype:?}"),
    }
}

/// Symmetric 8-bit blocks of `x` (used for types without an exact decoding here); codes are
/// rounded against the f16 scale that is stored.
fn requantize_row(x: &[f32], out: &mut Vec<Block>) {
    out.extend(x.chunks_exact(BLOCK).map(|v| {
        let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = f16::from_f32(amax / 127.0).to_f32();
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut codes = [0u8; BLOCK];
        for (c, &x) in codes.iter_mut().zip(v) {
            *c = ((x * inv).round_ties_even().clamp(-127.0, 127.0) as i32 + 128) as u8;
        }
        Block { codes, d, m: 0.0 }
    }));
}

impl PackedWeight {
    /// Repacks a `[rows, cols]` GGML tensor; float types are refused (they stay float).
    pub fn from_qtensor(t: &QTensor) -> Result<Self> {
        let (rows, cols) = t.shape().dims2()?;
        let dtype = t.dtype();
        if cols % BLOCK != 0 {
            bail!("{dtype:?} weight of width {cols} is not a multiple of {BLOCK}");
        }
        let Some(codes) = Codes::of(dtype) else {
            bail!("{dtype:?} weights are not block-quantized")
        };
        match dtype {
            GgmlDType::Q4_0
            | GgmlDType::Q4_1
            | GgmlDType::Q4K
            | GgmlDType::Q8_0
            | GgmlDType::Q5_0 => {
                let raw = t.data()?;
                let row_bytes = raw.len() / rows;
                Ok(Self::pack(rows, cols, codes, |r, out| {
                    decode_row(dtype, &raw[r * row_bytes..][..row_bytes], out)
                }))
            }
            _ => {
                let x: Vec<f32> = t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?;
                Ok(Self::from_f32(rows, cols, &x))
            }
        }
    }

    /// Symmetric 8-bit blocks of a row-major f32 matrix.
    pub fn from_f32(rows: usize, cols: usize, x: &[f32]) -> Self {
        assert!(cols.is_multiple_of(BLOCK) && x.len() == rows * cols);
        Self::pack(rows, cols, Codes::U8, |r, out| {
            requantize_row(&x[r * cols..][..cols], out)
        })
    }

    fn pack(
        rows: usize,
        cols: usize,
        codes: Codes,
        decode: impl Fn(usize, &mut Vec<Block>) + Sync,
    ) -> Self {
        let blocks = (cols / BLOCK).next_multiple_of(2);
        let zero = match codes {
            Codes::U4 => ZERO_U4,
            Codes::U8 => ZERO_U8,
        };
        let row_bytes = match codes {
            Codes::U4 => blocks * 16,
            Codes::U8 => blocks * BLOCK,
        };
        let per_row: Vec<(Vec<u8>, Vec<f16>, Vec<f16>)> = (0..rows)
            .into_par_iter()
            .map(|r| {
                let mut b = Vec::with_capacity(blocks);
                decode(r, &mut b);
                b.resize(blocks, zero);
                let mut bytes = Vec::with_capacity(row_bytes);
                match codes {
                    Codes::U4 => {
                        for pair in b.chunks_exact(2) {
                            bytes.extend(
                                (0..BLOCK).map(|j| pair[0].codes[j] | pair[1].codes[j] << 4),
                            );
                        }
                    }
                    Codes::U8 => b.iter().for_each(|b| bytes.extend_from_slice(&b.codes)),
                }
                let m = match codes {
                    Codes::U4 => b.iter().map(|b| f16::from_f32(b.m)).collect(),
                    Codes::U8 => Vec::new(),
                };
                (bytes, b.iter().map(|b| f16::from_f32(b.d)).collect(), m)
            })
            .collect();
        let mut w = Self {
            rows,
            cols,
            blocks,
            codes,
            data: Vec::with_capacity(rows * row_bytes),
            d: Vec::with_capacity(rows * blocks),
            m: Vec::new(),
        };
        for (bytes, d, m) in per_row {
            w.data.extend_from_slice(&bytes);
            w.d.extend_from_slice(&d);
            w.m.extend_from_slice(&m);
        }
        w
    }

    /// Stacks weights of one code form and width row-wise (Q|K|V, gate|up).
    pub fn stack(parts: Vec<PackedWeight>) -> Result<Self> {
        let first = &parts[0];
        let (cols, codes) = (first.cols, first.codes);
        if parts.iter().any(|p| p.cols != cols || p.codes != codes) {
            bail!("cannot stack weights of different widths or code forms");
        }
        let mut w = Self {
            rows: 0,
            cols,
            blocks: first.blocks,
            codes,
            data: Vec::new(),
            d: Vec::new(),
            m: Vec::new(),
        };
        for p in parts {
            w.rows += p.rows;
            w.data.extend(p.data);
            w.d.extend(p.d);
            w.m.extend(p.m);
        }
        Ok(w)
    }

    /// Bytes the kernels read per full pass over the matrix.
    pub fn bytes(&self) -> usize {
        self.data.len() + 2 * (self.d.len() + self.m.len())
    }

    /// [`Self::bytes`] of a `[rows, cols]` matrix packed as `codes`, before it is packed.
    pub fn bytes_for(rows: usize, cols: usize, codes: Codes) -> usize {
        let blocks = (cols / BLOCK).next_multiple_of(2);
        let (code_bytes, scales) = match codes {
            Codes::U4 => (blocks * 16, 2),
            Codes::U8 => (blocks * BLOCK, 1),
        };
        rows * (code_bytes + 2 * scales * blocks)
    }

    /// Weight `r`, `c` as the kernels see it (tests and references).
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let (b, j) = (c / BLOCK, c % BLOCK);
        let i = r * self.blocks + b;
        match self.codes {
            Codes::U4 => {
                let byte = self.data[r * self.blocks * 16 + (b / 2) * BLOCK + j];
                let code = if b % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                self.d[i].to_f32() * code as f32 + self.m[i].to_f32()
            }
            Codes::U8 => {
                let code = self.data[(r * self.blocks + b) * BLOCK + j] as i32 - 128;
                self.d[i].to_f32() * code as f32
            }
        }
    }
}
