// Weight rows as the matmul and embedding kernels read them (prepended to their files, which
// bind `w: array<vec4<u32>>`). FMT names the storage (blocks.rs): 0 f16 values, rows packed
// two to a word (read by `word`, or by the matrix-vector kernel as blocks of 8 values where
// rows are whole vectors); or blocks of 32 values kept quantized, their codes first (a
// block's in whole 16-byte vectors, read by wide loads), then each block's scale words from
// word `scales` on: one word with GGUF's f16 scale (and min) for 1 Q8_0 (two vectors of int8
// codes), 2 Q4_0 (a vector of nibbles, value (q - 8) d), 3 Q4_1 (value q d + m); two f32
// words for the K-quants cut into blocks: 4 Q4_K (nibbles, q d + m), 5 Q5_K (bytes, q d + m),
// 6 Q6_K (int8 codes, d of values 0-15 then of 16-31). Values are dequantized in registers.

override FMT: u32 = 0u;

// Values of a block: 8 for f16 (one vector), 32 for GGUF blocks.
fn block_values() -> u32 {
    return select(32u, 8u, FMT == 0u);
}

fn word(i: u32) -> u32 {
    return w[i / 4u][i % 4u];
}

// Words of an f16 row of `k` values.
fn f16_row_words(k: u32) -> u32 {
    return (k + 1u) / 2u;
}

// A quantized block: its codes and its scale (and min).
struct Block {
    c0: vec4<u32>,
    c1: vec4<u32>,
    s: vec2<f32>,
}

// Block `i` of a part (row n's block b is n * k / 32 + b), scales from word `scales` on.
fn block(i: u32, scales: u32) -> Block {
    var b: Block;
    if FMT == 0u {
        b.c0 = w[i];
        return b;
    }
    // Two vectors of byte codes, or one of nibbles.
    if FMT == 1u || FMT >= 5u {
        b.c0 = w[2u * i];
        b.c1 = w[2u * i + 1u];
    } else {
        b.c0 = w[i];
    }
    if FMT >= 4u {
        b.s = vec2<f32>(bitcast<f32>(word(scales + 2u * i)), bitcast<f32>(word(scales + 2u * i + 1u)));
    } else {
        b.s = unpack2x16float(word(scales + i));
    }
    return b;
}

// Codes 4j..4j+3 of block `b` (j in 0..8; an f16 block's in 0..2) as numbers, before
// [`affine`]: byte codes in order, or a Q4 block's low nibbles (j < 4: those of word j) and
// high nibbles (j >= 4: those of word j - 4); an f16 block's values.
fn codes(b: Block, j: u32) -> vec4<f32> {
    if FMT == 0u {
        return vec4<f32>(unpack2x16float(b.c0[2u * j]), unpack2x16float(b.c0[2u * j + 1u]));
    }
    if FMT == 1u || FMT >= 5u {
        var code = b.c0[j % 4u];
        if j >= 4u {
            code = b.c1[j % 4u];
        }
        if FMT == 5u {
            return vec4<f32>(unpack4xU8(code));
        }
        return vec4<f32>(unpack4xI8(code));
    }
    let code = b.c0[j % 4u] >> (4u * (j / 4u));
    return vec4<f32>(unpack4xU8(code & 0x0f0f0f0fu));
}

// The scale and offset of codes 4j.. of block `b`: value = code * d + m (one pair a block;
// Q6_K's d of values 0-15, then of 16-31).
fn affine(b: Block, j: u32) -> vec2<f32> {
    switch FMT {
        case 0u: {
            return vec2<f32>(1.0, 0.0);
        }
        case 1u: {
            return vec2<f32>(b.s.x, 0.0);
        }
        case 2u: {
            return vec2<f32>(b.s.x, -8.0 * b.s.x);
        }
        case 6u: {
            return vec2<f32>(select(b.s.x, b.s.y, j >= 4u), 0.0);
        }
        default: {
            return b.s;
        }
    }
}

// Values 4j..4j+3 of block `b`.
fn quad(b: Block, j: u32) -> vec4<f32> {
    let a = affine(b, j);
    return codes(b, j) * a.x + a.y;
}
