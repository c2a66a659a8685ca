// RMSNorm of rows, one workgroup per output row: y[r] = x[src] / rms(x[src]) * w, where src
// is `idx[gather + r]` (a row gather: logits rows, an MTP head's rows) or r. `add`: y += ...
// (a norm after attention or MLP added into the residual); `norm` 0: a plain copy.

struct P {
    cols: u32,
    eps: f32,
    gather: u32,
    add: u32,
    norm: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<f32>;
@group(0) @binding(2) var<storage, read> idx: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let r = g.x;
    var src = r;
    if p.gather != NONE {
        src = idx[p.gather + r];
    }
    let xr = src * p.cols;
    var inv = 1.0;
    if p.norm != 0u {
        // Four loads in flight per thread: a decode's row is one workgroup's whole work.
        var ss = vec4<f32>(0.0);
        for (var c = i; c < p.cols; c += 4u * WG) {
            for (var u = 0u; u < 4u; u++) {
                let cu = c + u * WG;
                if cu < p.cols {
                    let v = x[xr + cu];
                    ss[u] += v * v;
                }
            }
        }
        inv = inverseSqrt(total(ss.x + ss.y + ss.z + ss.w, i) / f32(p.cols) + p.eps);
    }
    let yr = r * p.cols;
    for (var c = i; c < p.cols; c += 4u * WG) {
        for (var u = 0u; u < 4u; u++) {
            let cu = c + u * WG;
            if cu < p.cols {
                var v = x[xr + cu];
                if p.norm != 0u {
                    v *= inv * w[cu];
                }
                if p.add != 0u {
                    v += y[yr + cu];
                }
                y[yr + cu] = v;
            }
        }
    }
}
