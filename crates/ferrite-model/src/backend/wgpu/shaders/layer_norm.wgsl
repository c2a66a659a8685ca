// LayerNorm of each row in place, one workgroup per row (encoders).

struct P {
    cols: u32,
    eps: f32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> w: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;

const WG: u32 = 256u;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let r = g.x * p.cols;
    var s = 0.0;
    for (var c = i; c < p.cols; c += WG) {
        s += x[r + c];
    }
    let mean = total(s, i) / f32(p.cols);
    var ss = 0.0;
    for (var c = i; c < p.cols; c += WG) {
        let d = x[r + c] - mean;
        ss += d * d;
    }
    let inv = inverseSqrt(total(ss, i) / f32(p.cols) + p.eps);
    for (var c = i; c < p.cols; c += WG) {
        x[r + c] = (x[r + c] - mean) * inv * w[c] + b[c];
    }
}
