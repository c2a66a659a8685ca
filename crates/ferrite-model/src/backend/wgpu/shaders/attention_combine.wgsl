// Attention's splits of the keys combined, one workgroup per (query head, token): each
// split's part is [maximum, sum, d unnormalized outputs] (attention.wgsl); the output is
// their sum rescaled to the largest maximum, over the total.

struct P {
    heads: u32,
    d: u32,
    splits: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> parts: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let row = g.y * p.heads + g.x;
    let first = row * p.splits * (p.d + 2u);
    var m = -3.0e38;
    for (var s = 0u; s < p.splits; s++) {
        m = max(m, parts[first + s * (p.d + 2u)]);
    }
    var l = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        let at = first + s * (p.d + 2u);
        l += parts[at + 1u] * exp(parts[at] - m);
    }
    for (var e = i; e < p.d; e += 64u) {
        var v = 0.0;
        for (var s = 0u; s < p.splits; s++) {
            let at = first + s * (p.d + 2u);
            v += parts[at + 2u + e] * exp(parts[at] - m);
        }
        out[row * p.d + e] = v / l;
    }
}
