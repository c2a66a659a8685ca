// Embedding rows: y[t] (+)= table[ids[t] - first] * scale, f16 rows packed two to a word.
// A table split over bindings takes one launch per part: each writes the rows of the ids it
// holds (ids past the whole vocabulary are refused on the host).

struct P {
    cols: u32,
    ids: u32,
    first: u32,
    vocab: u32,
    scale: f32,
    add: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> ids: array<u32>;
@group(0) @binding(1) var<storage, read> table: array<u32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let t = g.x;
    let id = ids[p.ids + t] - p.first;
    if id >= p.vocab {
        return;
    }
    let words = (p.cols + 1u) / 2u;
    let yr = t * p.cols;
    for (var c2 = i; c2 < words; c2 += 64u) {
        let v = unpack2x16float(table[id * words + c2]) * p.scale;
        for (var j = 0u; j < 2u; j++) {
            let c = 2u * c2 + j;
            if c < p.cols {
                if p.add != 0u {
                    y[yr + c] += v[j];
                } else {
                    y[yr + c] = v[j];
                }
            }
        }
    }
}
