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
//! Rows hold an even number of blocks (a zero block pads odd widths). Two layouts of the same
//! bytes ([`Layout`]): rows contiguous (the AVX2 and portable kernels), or panels of 16 rows
//! in the order AMX tiles and `vpdpbusd` over 16 row lanes read (the `amx` and `avx512-vnni`
//! kernel sets).

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

/// Where a matrix's bytes lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Row after row: per row, 32 bytes per block (`U8`) or per pair of blocks (`U4`), then
    /// the scales `[rows, blocks]`.
    Rows,
    /// 16 rows at a time (the last panel padded with zero rows): per panel and 32-byte slot,
    /// 8 groups of 16 rows x 4 bytes (`[k / 4][row][k % 4]`, an AMX B tile); scales
    /// `[panel][block][16 rows]`.
    Panels,
}

/// Rows per panel.
pub const PANEL_ROWS: usize = 16;

#[derive(Clone)]
pub struct PackedWeight {
    pub rows: usize,
    pub cols: usize,
    /// Blocks per row, padded to even.
    pub blocks: usize,
    pub codes: Codes,
    pub layout: Layout,
    /// Codes: `blocks * 16` bytes per row for `U4`, `blocks * 32` for `U8`.
    pub data: Vec<u8>,
    /// Per-block scale; f16 like GGML's, to keep decode's bytes down.
    pub d: Vec<f16>,
    /// Per-block offset, `U4` only.
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
            layout: Layout::Rows,
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

    /// Stacks weights of one code form and width row-wise (Q|K|V, gate|up), before they are
    /// laid out in panels.
    pub fn stack(parts: Vec<PackedWeight>) -> Result<Self> {
        let first = &parts[0];
        let (cols, codes) = (first.cols, first.codes);
        if parts.iter().any(|p| p.cols != cols || p.codes != codes) {
            bail!("cannot stack weights of different widths or code forms");
        }
        assert!(parts.iter().all(|p| p.layout == Layout::Rows));
        let mut w = Self {
            rows: 0,
            cols,
            blocks: first.blocks,
            codes,
            layout: Layout::Rows,
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

    /// Bytes per row and 32-byte slot count per row (a slot: one `U8` block, one `U4` pair).
    fn slots(&self) -> usize {
        match self.codes {
            Codes::U4 => self.blocks / 2,
            Codes::U8 => self.blocks,
        }
    }

    /// The same matrix in `layout` (panels: rows padded to a multiple of 16 with zeros).
    pub fn into_layout(self, layout: Layout) -> Self {
        if layout == self.layout {
            return self;
        }
        assert_eq!(
            self.layout,
            Layout::Rows,
            "panels are only laid out from rows"
        );
        let (nb, slots) = (self.blocks, self.slots());
        let panels = self.rows.div_ceil(PANEL_ROWS);
        let mut data = vec![0u8; panels * PANEL_ROWS * slots * BLOCK];
        for (r, row) in self.data.chunks_exact(slots * BLOCK).enumerate() {
            let (p, i) = (r / PANEL_ROWS, r % PANEL_ROWS);
            for (s, slot) in row.chunks_exact(BLOCK).enumerate() {
                let dst = &mut data[(p * slots + s) * PANEL_ROWS * BLOCK..][..PANEL_ROWS * BLOCK];
                for (k4, four) in slot.chunks_exact(4).enumerate() {
                    dst[k4 * 64 + i * 4..][..4].copy_from_slice(four);
                }
            }
        }
        let scales = |v: &[f16]| -> Vec<f16> {
            if v.is_empty() {
                return Vec::new();
            }
            let mut out = vec![f16::ZERO; panels * PANEL_ROWS * nb];
            for (r, row) in v.chunks_exact(nb).enumerate() {
                let (p, i) = (r / PANEL_ROWS, r % PANEL_ROWS);
                for (b, &x) in row.iter().enumerate() {
                    out[(p * nb + b) * PANEL_ROWS + i] = x;
                }
            }
            out
        };
        Self {
            d: scales(&self.d),
            m: scales(&self.m),
            data,
            layout,
            ..self
        }
    }

    /// Where row `r`'s byte `j` of slot `s` and its block `b` scale lie.
    fn at(&self, r: usize, s: usize, j: usize, b: usize) -> (usize, usize) {
        let (nb, slots) = (self.blocks, self.slots());
        match self.layout {
            Layout::Rows => ((r * slots + s) * BLOCK + j, r * nb + b),
            Layout::Panels => {
                let (p, i) = (r / PANEL_ROWS, r % PANEL_ROWS);
                (
                    (p * slots + s) * PANEL_ROWS * BLOCK + (j / 4) * 64 + i * 4 + j % 4,
                    (p * nb + b) * PANEL_ROWS + i,
                )
            }
        }
    }

    /// Bytes the kernels read per full pass over the matrix.
    pub fn bytes(&self) -> usize {
        self.data.len() + 2 * (self.d.len() + self.m.len())
    }

    /// [`Self::bytes`] of a `[rows, cols]` matrix packed as `codes`, before it is packed.
    pub fn bytes_for(rows: usize, cols: usize, codes: Codes, layout: Layout) -> usize {
        let blocks = (cols / BLOCK).next_multiple_of(2);
        let rows = match layout {
            Layout::Rows => rows,
            Layout::Panels => rows.next_multiple_of(PANEL_ROWS),
        };
        let (code_bytes, scales) = match codes {
            Codes::U4 => (blocks * 16, 2),
            Codes::U8 => (blocks * BLOCK, 1),
        };
        rows * (code_bytes + 2 * scales * blocks)
    }

    /// Weight `r`, `c` as the kernels see it (tests and references).
    pub fn get(&self, r: usize, c: usize) -> f32 {
        let (b, j) = (c / BLOCK, c % BLOCK);
        match self.codes {
            Codes::U4 => {
                let (at, i) = self.at(r, b / 2, j, b);
                let byte = self.data[at];
                let code = if b % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                self.d[i].to_f32() * code as f32 + self.m[i].to_f32()
            }
            Codes::U8 => {
                let (at, i) = self.at(r, b, j, b);
                self.d[i].to_f32() * (self.data[at] as i32 - 128) as f32
            }
        }
    }
}
