// A mixture-of-experts layer's routing, one workgroup per token: a softmax over the token's
// router logits (`logits` [T, width], the routed experts first, then the shared expert's
// gate if any), its `top_k` largest (lower index first on ties), rescaled to sum to 1 with
// `norm`. Writes the token's experts to `route` [T * top_k] and their weights after them
// (from word T * top_k on, as f32 bits), the order the expert kernels read them in.

struct P {
    experts: u32,
    width: u32,
    top_k: u32,
    norm: u32,
    tokens: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> route: array<u32>;

const WG: u32 = 64u;
var<workgroup> best: array<vec2<f32>, WG>;

// The larger of two (value, index) pairs, the lower index on ties.
fn better(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    if b.x > a.x || (b.x == a.x && b.y < a.y) {
        return b;
    }
    return a;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let t = g.x;
    let row = t * p.width;
    var m = -3.0e38;
    for (var e = i; e < p.experts; e += WG) {
        m = max(m, logits[row + e]);
    }
    best[i] = vec2<f32>(m, 0.0);
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if i < s {
            best[i].x = max(best[i].x, best[i + s].x);
        }
        workgroupBarrier();
    }
    let top = best[0].x;
    workgroupBarrier();
    var sum = 0.0;
    for (var e = i; e < p.experts; e += WG) {
        sum += exp(logits[row + e] - top);
    }
    best[i] = vec2<f32>(sum, 0.0);
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if i < s {
            best[i].x += best[i + s].x;
        }
        workgroupBarrier();
    }
    let total = best[0].x;
    workgroupBarrier();
    // k rounds of the largest not yet taken: an expert taken is below every probability.
    var taken = -1.0;
    var kept = 0.0;
    let out = t * p.top_k;
    let weights = p.tokens * p.top_k;
    for (var j = 0u; j < p.top_k; j++) {
        var pick = vec2<f32>(-2.0, 0.0);
        for (var e = i; e < p.experts; e += WG) {
            var prob = exp(logits[row + e] - top) / total;
            for (var q = 0u; q < j; q++) {
                if route[out + q] == e {
                    prob = taken;
                }
            }
            pick = better(pick, vec2<f32>(prob, f32(e)));
        }
        best[i] = pick;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if i < s {
                best[i] = better(best[i], best[i + s]);
            }
            workgroupBarrier();
        }
        let chosen = best[0];
        if i == 0u {
            route[out + j] = u32(chosen.y);
            route[weights + out + j] = bitcast<u32>(chosen.x);
        }
        kept += chosen.x;
        storageBarrier();
        workgroupBarrier();
    }
    if p.norm != 0u && i < p.top_k {
        let at = weights + out + i;
        route[at] = bitcast<u32>(bitcast<f32>(route[at]) / kept);
    }
}
