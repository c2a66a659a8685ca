// A mixture-of-experts layer's sum into the residual stream, a thread per value:
// x[t, c] += sum_j weight[t, j] * down[t * top_k + j, c] (the experts moe_route.wgsl chose,
// in its order), plus the shared expert's output `always` [T, h], scaled by
// sigmoid(logits[t, width - 1]) where it has a gate.

struct P {
    h: u32,
    top_k: u32,
    tokens: u32,
    width: u32,
    // 0: no shared expert, 1: one, 2: one with a gate.
    always: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> down: array<f32>;
@group(0) @binding(1) var<storage, read> route: array<u32>;
@group(0) @binding(2) var<storage, read> always: array<f32>;
@group(0) @binding(3) var<storage, read> logits: array<f32>;
@group(0) @binding(4) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = (id.y * 65535u * 256u) + id.x;
    if i >= p.tokens * p.h {
        return;
    }
    let t = i / p.h;
    let c = i % p.h;
    let weights = p.tokens * p.top_k;
    var acc = 0.0;
    for (var j = 0u; j < p.top_k; j++) {
        let pair = t * p.top_k + j;
        acc += bitcast<f32>(route[weights + pair]) * down[pair * p.h + c];
    }
    if p.always != 0u {
        var gate = 1.0;
        if p.always == 2u {
            gate = 1.0 / (1.0 + exp(-logits[t * p.width + p.width - 1u]));
        }
        acc += gate * always[i];
    }
    x[i] += acc;
}
