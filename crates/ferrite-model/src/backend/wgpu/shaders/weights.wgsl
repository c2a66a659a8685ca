// Weight rows as the matmul kernels read them (prepended to gemv.wgsl and matmul.wgsl). FMT
// names the storage: 0 f16 values packed two to a word; GGUF blocks of 32 values kept
// quantized, each with its f16 scale (and min) in a word of its own: 1 Q8_0 (then 8 words of
// int8 codes), 2 Q4_0 (4 words of nibbles, value (q - 8) d), 3 Q4_1 (value q d + m). Values
// are dequantized in registers.

override FMT: u32 = 0u;

// Words of one row of `k` values.
fn row_words(k: u32) -> u32 {
    switch FMT {
        case 1u: {
            return k / 32u * 9u;
        }
        case 2u, 3u: {
            return k / 32u * 5u;
        }
        default: {
            return (k + 1u) / 2u;
        }
    }
}

// Values 4j..4j+3 of the block at word `at` (j in 0..8): a Q8_0 block's int8 codes, or a Q4
// block's low nibbles (j < 4: values 4j.. are those of word j) and high nibbles (j >= 4:
// values 16 + 4(j-4).. are those of word j - 4).
fn block_quad(at: u32, j: u32) -> vec4<f32> {
    let s = unpack2x16float(w[at]);
    if FMT == 1u {
        return vec4<f32>(unpack4xI8(w[at + 1u + j])) * s.x;
    }
    let word = w[at + 1u + j % 4u] >> (4u * (j / 4u));
    let q = vec4<f32>(unpack4xU8(word & 0x0f0f0f0fu));
    if FMT == 2u {
        return (q - 8.0) * s.x;
    }
    return q * s.x + s.y;
}

// Words of one block.
fn block_words() -> u32 {
    if FMT == 1u {
        return 9u;
    }
    return 5u;
}
