// Element-wise ops over activations: `a` is read, `y` written; one thread per element of y.

struct P {
    n: u32,
    width: u32,
    op: u32,
    cap: f32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;

fn gelu_erf(v: f32) -> f32 {
    return 0.5 * v * (1.0 + erf(v * 0.7071067811865476));
}

// WGSL has no erf: Numerical Recipes' erfc, fractional error below 1.2e-7.
fn erf(v: f32) -> f32 {
    let z = abs(v);
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t * exp(-z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418
        + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587
        + t * (-0.82215223 + t * 0.17087277)))))))));
    return select(r - 1.0, 1.0 - r, v >= 0.0);
}

fn index(g: vec3<u32>, i: u32) -> u32 {
    return (g.y * 65535u + g.x) * 256u + i;
}

// y[r, c] = act(a[r, c]) * a[r, width + c]: a gated MLP's [gate | up] rows; `op` 0 SiLU,
// 1 GELU (tanh).
@compute @workgroup_size(256)
fn gated(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let e = index(g, i);
    if e >= p.n {
        return;
    }
    let r = e / p.width;
    let c = e % p.width;
    let gate = a[2u * r * p.width + c];
    let up = a[(2u * r + 1u) * p.width + c];
    y[e] = gate_activation(p.op, gate) * up;
}

// y *= sigmoid(a).
@compute @workgroup_size(256)
fn gate_sigmoid(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let e = index(g, i);
    if e < p.n {
        y[e] *= 1.0 / (1.0 + exp(-a[e]));
    }
}

// y[r, c] += a[c], then `op`: 0 nothing, 1 GELU (erf), 2 tanh.
@compute @workgroup_size(256)
fn add_bias(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let e = index(g, i);
    if e >= p.n {
        return;
    }
    var v = y[e] + a[e % p.width];
    if p.op == 1u {
        v = gelu_erf(v);
    } else if p.op == 2u {
        v = tanh_(v);
    }
    y[e] = v;
}

// y = cap * tanh(y / cap) (`a` unread).
@compute @workgroup_size(256)
fn softcap(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let e = index(g, i);
    if e < p.n {
        y[e] = p.cap * tanh_(y[e] / p.cap);
    }
}
