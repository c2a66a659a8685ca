//! Weight matrices on the GPU: GGUF blocks of Q8_0, Q4_0 and Q4_1 kept quantized (each block's
//! scale moved to a word of its own, its codes after it), every other type as f16 (WGSL has
//! no bf16), rows packed two to a word; a matrix larger than one binding is split by rows
//! into parts, each multiplied by its own launch.

use super::device::Gpu;
use super::kernels::{launch, spread, Kernels, GEMV_ROWS};
use super::tensors::{f16_words, upload_words};
use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use rand::Rng;

/// How a matrix's rows are stored (`FMT` in weights.wgsl: the enum's order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
}

impl Format {
    /// A GGUF type's storage here: its own blocks where the kernels read them.
    fn of(dtype: GgmlDType) -> Self {
        match dtype {
            GgmlDType::Q8_0 => Self::Q8_0,
            GgmlDType::Q4_0 => Self::Q4_0,
            GgmlDType::Q4_1 => Self::Q4_1,
            _ => Self::F16,
        }
    }

    /// Words of a row of `cols` values (codes and scales).
    pub fn row_words(self, cols: usize) -> usize {
        match self {
            Self::F16 => cols.div_ceil(2),
            _ => cols / 32 * (1 + self.code_words()),
        }
    }

    /// Words of a block's codes.
    fn code_words(self) -> usize {
        match self {
            Self::F16 => 0,
            Self::Q8_0 => 8,
            Self::Q4_0 | Self::Q4_1 => 4,
        }
    }

    /// GGUF bytes of one block of 32 values.
    fn gguf_block(self) -> usize {
        match self {
            Self::F16 => 0,
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
        }
    }
}

/// Quantized rows as the kernels read them: every block's codes (whole 16-byte vectors:
/// Q8_0's 32 bytes, a Q4 block's 16), and per block a word with its f16 scale (and min: two
/// GGUF f16s), both in row order.
struct Blocks {
    codes: Vec<u32>,
    scales: Vec<u32>,
}

fn repack(format: Format, bytes: &[u8]) -> Blocks {
    let head = match format {
        Format::Q4_1 => 4,
        _ => 2,
    };
    let blocks = bytes.len() / format.gguf_block();
    let mut out = Blocks {
        codes: Vec::with_capacity(bytes.len() / 4),
        scales: Vec::with_capacity(blocks),
    };
    for block in bytes.chunks_exact(format.gguf_block()) {
        let mut scales = [0u8; 4];
        scales[..head].copy_from_slice(&block[..head]);
        out.scales.push(u32::from_le_bytes(scales));
        let word = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        out.codes.extend(block[head..].chunks_exact(4).map(word));
    }
    out
}

/// Rows `first..first + rows` of a matrix; a quantized part's block scales from word
/// `scales` on.
pub struct Part {
    pub buf: wgpu::Buffer,
    pub first: usize,
    pub rows: usize,
    pub scales: usize,
}

/// A `[rows, cols]` matrix (projections of one input stacked by rows).
pub struct Linear {
    pub parts: Vec<Part>,
    pub rows: usize,
    pub cols: usize,
    pub format: Format,
}

impl Linear {
    /// `parts` stacked by rows: kept in their GGUF blocks when they all share a type the
    /// kernels read, else dequantized and stored as f16.
    pub fn upload(gpu: &Gpu, parts: &[QTensor]) -> Result<Self> {
        let mut cols = None;
        for p in parts {
            let (_, c) = p.shape().dims2()?;
            if cols.is_some_and(|w| w != c) {
                bail!(
                    "stacked projections of {} and {c} columns",
                    cols.unwrap_or(0)
                );
            }
            cols = Some(c);
        }
        let cols = cols.unwrap_or(0);
        let format = match parts.first().map(|p| Format::of(p.dtype())) {
            Some(f) if parts.iter().all(|p| Format::of(p.dtype()) == f) => f,
            _ => Format::F16,
        };
        let blocks = match format {
            Format::F16 => {
                let mut values = Vec::new();
                for p in parts {
                    values.extend(
                        p.dequantize(&Device::Cpu)?
                            .flatten_all()?
                            .to_vec1::<f32>()?,
                    );
                }
                Blocks {
                    codes: f16_words(&values, cols),
                    scales: Vec::new(),
                }
            }
            _ => {
                let mut all = Blocks {
                    codes: Vec::new(),
                    scales: Vec::new(),
                };
                for p in parts {
                    let b = repack(format, &p.data()?);
                    all.codes.extend(b.codes);
                    all.scales.extend(b.scales);
                }
                all
            }
        };
        Self::from_blocks(gpu, &blocks, cols, format)
    }

    /// Random Q8_0 rows (`--load-format dummy`), stacked: a pool of random blocks tiled
    /// from a random start (a benchmark needs the bytes, not billions of fresh draws).
    pub fn random(gpu: &Gpu, rows: &[usize], cols: usize) -> Result<Self> {
        const POOL: usize = 1 << 16;
        let mut rng = rand::rng();
        // Codes uniform in -128..=127 (deviation ~74), scaled to a deviation of 0.02.
        let scale = half::f16::from_f32(0.02 / 73.9).to_bits() as u32;
        let pool: Vec<u32> = (0..POOL * 8).map(|_| rng.random()).collect();
        let blocks = rows.iter().sum::<usize>() * cols / 32;
        let start = rng.random_range(0..POOL);
        let codes = (0..blocks)
            .flat_map(|b| {
                let at = 8 * ((start + b) % POOL);
                pool[at..at + 8].iter().copied()
            })
            .collect();
        let blocks = Blocks {
            codes,
            scales: vec![scale; blocks],
        };
        Self::from_blocks(gpu, &blocks, cols, Format::Q8_0)
    }

    fn from_blocks(gpu: &Gpu, blocks: &Blocks, cols: usize, format: Format) -> Result<Self> {
        let row_words = format.row_words(cols);
        // Per row: its codes (f16 words for F16), and its blocks' scale words.
        let (code_row, scale_row) = match format {
            Format::F16 => (row_words, 0),
            _ => (cols / 32 * format.code_words(), cols / 32),
        };
        let rows = blocks.codes.len() / code_row.max(1);
        // A 16-byte vector past each part for the padding.
        let limit = gpu.limits.max_storage_buffer_binding_size as usize - 16;
        let per_part = (limit / (4 * row_words.max(1))).min(rows.max(1));
        if per_part == 0 {
            bail!("a row of {cols} values does not fit one binding");
        }
        let parts = (0..rows.max(1))
            .step_by(per_part)
            .map(|first| {
                let n = per_part.min(rows - first);
                let mut words = blocks.codes[first * code_row..][..n * code_row].to_vec();
                let scales = words.len();
                if scale_row > 0 {
                    words.extend_from_slice(&blocks.scales[first * scale_row..][..n * scale_row]);
                }
                // Bound as 16-byte vectors.
                words.resize(words.len().next_multiple_of(4), 0);
                Part {
                    buf: upload_words(gpu, "weights", &words),
                    first,
                    rows: n,
                    scales,
                }
            })
            .collect();
        Ok(Self {
            parts,
            rows,
            cols,
            format,
        })
    }

    pub fn bytes(&self) -> usize {
        4 * self.rows * self.format.row_words(self.cols)
    }
}

/// Where a matmul writes: `y[m, off + n]` in rows of `ldy`, stored or added.
pub struct Out<'a> {
    pub y: &'a wgpu::Buffer,
    pub ldy: usize,
    pub add: bool,
}

/// Which kernels a matmul takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// Matrix-vector up to [`GEMV_ROWS`] rows, tiles past that (GPUs).
    Gpu,
    /// Matrix-vector up to [`GEMV_ROWS`] rows, tiles on cooperative matrices past that (GPUs
    /// that have them).
    Coop,
    /// Matrix-vector [`GEMV_ROWS`] rows at a time whatever the count: a CPU driver
    /// (lavapipe) runs tiles through workgroup memory slowly.
    Cpu,
    /// Tiles always: a row's sums run in one order whatever its company (`--batch-invariant`).
    Tiled,
}

/// `y (+)= x w^T` for `m` rows of `x`.
pub fn matmul(
    gpu: &Gpu,
    k: &Kernels,
    pass: &mut wgpu::ComputePass<'static>,
    (x, m): (&wgpu::Buffer, usize),
    w: &Linear,
    out: Out,
    pick: Pick,
) {
    // The matrix-vector kernel reads f16 rows as whole 16-byte vectors.
    let vectors = (w.format != Format::F16 || w.cols.is_multiple_of(8))
        && match pick {
            Pick::Gpu | Pick::Coop => m <= GEMV_ROWS,
            Pick::Cpu => true,
            Pick::Tiled => false,
        };
    for p in &w.parts {
        let params = |rows: usize, row0: usize| {
            [
                rows as u32,
                p.rows as u32,
                w.cols as u32,
                out.ldy as u32,
                p.first as u32,
                out.add as u32,
                row0 as u32,
                p.scales as u32,
            ]
        };
        let buffers = [x, &p.buf, out.y];
        if !vectors {
            let groups = [p.rows.div_ceil(64) as u32, m.div_ceil(64) as u32, 1];
            let tiles = match pick {
                Pick::Coop if !k.matmul_coop.is_empty() => &k.matmul_coop,
                _ => &k.matmul,
            };
            launch(
                gpu,
                pass,
                &tiles[w.format as usize],
                &buffers,
                &params(m, 0),
                groups,
            );
            continue;
        }
        for row0 in (0..m).step_by(GEMV_ROWS) {
            let rows = GEMV_ROWS.min(m - row0);
            let groups = spread(p.rows.div_ceil(k.gemv_workgroup_rows(rows)));
            launch(
                gpu,
                pass,
                &k.gemv[w.format as usize][rows - 1],
                &buffers,
                &params(rows, row0),
                groups,
            );
        }
    }
}
