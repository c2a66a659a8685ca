// Embedding rows: y[t] (+)= w[ids[t] - first] * scale, the table stored as weights.wgsl says.
// A table split over bindings takes one launch per part: each writes the rows of the ids it
// holds (ids past the whole vocabulary are refused on the host).

struct P {
    cols: u32,
    ids: u32,
    first: u32,
    vocab: u32,
    scale: f32,
    add: u32,
    // The word where a quantized part's block scales start.
    scales: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> ids: array<u32>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

fn put(at: u32, v: f32) {
    if p.add != 0u {
        y[at] += v;
    } else {
        y[at] = v;
    }
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let t = g.x;
    let id = ids[p.ids + t] - p.first;
    if id >= p.vocab {
        return;
    }
    let words = f16_row_words(p.cols);
    let yr = t * p.cols;
    // Quantized rows: a thread per quad of values.
    for (var q = i; FMT != 0u && q < p.cols / 4u; q += 64u) {
        let v = quad(block(id * (p.cols / 32u) + q / 8u, p.scales), q % 8u) * p.scale;
        for (var j = 0u; j < 4u; j++) {
            put(yr + 4u * q + j, v[j]);
        }
    }
    for (var c2 = i; FMT == 0u && c2 < words; c2 += 64u) {
        let v = unpack2x16float(word(id * words + c2)) * p.scale;
        for (var j = 0u; j < 2u; j++) {
            let c = 2u * c2 + j;
            if c < p.cols {
                put(yr + c, v[j]);
            }
        }
    }
}
