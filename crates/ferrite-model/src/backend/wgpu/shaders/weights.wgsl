// Weight rows as the matmul and embedding kernels read them (prepended to their files, which
// bind `w: array<vec4<u32>>`). FMT names the storage: 0 f16 values, rows packed two to a word
// (read by `word`, or by the matrix-vector kernel as blocks of 8 values where rows are whole
// vectors);
// or GGUF blocks of 32 values kept quantized, their codes first (a block's in whole 16-byte
// vectors, read by wide loads), then one word per block with its f16 scale (and min) from
// word `scales` on: 1 Q8_0 (two vectors of int8 codes), 2 Q4_0 (a vector of nibbles, value
// (q - 8) d), 3 Q4_1 (value q d + m). Values are dequantized in registers.

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
    if FMT == 1u {
        b.c0 = w[2u * i];
        b.c1 = w[2u * i + 1u];
    } else {
        b.c0 = w[i];
    }
    b.s = unpack2x16float(word(scales + i));
    return b;
}

// Values 4j..4j+3 of block `b` (j in 0..8; an f16 block's in 0..2): Q8_0's int8 codes in
// order, or a Q4 block's low nibbles (j < 4: those of word j) and high nibbles (j >= 4: those
// of word j - 4).
fn quad(b: Block, j: u32) -> vec4<f32> {
    if FMT == 0u {
        return vec4<f32>(unpack2x16float(b.c0[2u * j]), unpack2x16float(b.c0[2u * j + 1u]));
    }
    if FMT == 1u {
        var code = b.c0[j % 4u];
        if j >= 4u {
            code = b.c1[j % 4u];
        }
        return vec4<f32>(unpack4xI8(code)) * b.s.x;
    }
    let code = b.c0[j % 4u] >> (4u * (j / 4u));
    let q = vec4<f32>(unpack4xU8(code & 0x0f0f0f0fu));
    if FMT == 2u {
        return (q - 8.0) * b.s.x;
    }
    return q * b.s.x + b.s.y;
}
