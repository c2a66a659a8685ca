// One token per logits row (`logits` [R, n]), a workgroup per row, as the row's draw
// parameters say (`params` [R, 7] u32: temperature, min_p, top_p as f32 bits, top_k, the
// key's low and high words, whether the row is masked). Temperature 0: the largest logit,
// ties to the lower index. Otherwise a draw from softmax(l / T) by the Gumbel-max trick
// (argmax of l / T + Gumbel noise hashed from the key and the token) among the tokens the
// CPU sampler keeps, found as logit thresholds instead of a sort: the top_k largest, then
// the most likely whose probabilities reach top_p, then those with p >= min_p * p_max (ties
// at a threshold all stay). A masked row's tokens whose bit in `masks` ([R, words], bit
// t % 32 of word t / 32) is clear are never drawn, nor NaN.

struct P {
    n: u32,
    words: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read> params: array<u32>;
@group(0) @binding(2) var<storage, read> masks: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;

const WG: u32 = 256u;
// Below every logit: a token cut.
const CUT: f32 = -3.0e38;
const NO_TOKEN: u32 = 0xffffffffu;

var<workgroup> row_params: array<u32, 7>;
var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

// Token t's logit in row r, CUT where its mask clears it (or it is NaN).
fn logit(r: u32, t: u32, masked: bool) -> f32 {
    let l = logits[r * p.n + t];
    if l != l || (masked && ((masks[r * p.words + t / 32u] >> (t % 32u)) & 1u) == 0u) {
        return CUT;
    }
    return l;
}

// Floats as unsigned ints in the same order (for the halvings over values).
fn ordered(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn mix(h: u32) -> u32 {
    var x = h;
    x ^= x >> 16u;
    x *= 0x7feb352du;
    x ^= x >> 15u;
    x *= 0x846ca68bu;
    x ^= x >> 16u;
    return x;
}

// The row's noise for one token in (0, 1): a pure function of the key and the token, so a
// seeded request draws the same token whatever else shares the step.
fn uniform01(key: vec2<u32>, token: u32) -> f32 {
    let h = mix(mix(key.x ^ mix(token + 0x9e3779b9u)) ^ key.y);
    return (f32(h >> 8u) + 0.5) / 16777216.0;
}

// The best (value, index) over the workgroup: larger value, ties to the lower index.
fn best(v: f32, idx: u32, i: u32) -> vec2<u32> {
    best_v[i] = v;
    best_i[i] = idx;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if i < s {
            let v2 = best_v[i + s];
            let i2 = best_i[i + s];
            if v2 > best_v[i] || (v2 == best_v[i] && i2 < best_i[i]) {
                best_v[i] = v2;
                best_i[i] = i2;
            }
        }
        workgroupBarrier();
    }
    let b = vec2<u32>(bitcast<u32>(best_v[0]), best_i[0]);
    workgroupBarrier();
    return b;
}

// The largest ordered value u with sum(u) >= want, where sum(u) sums over the row's tokens
// l > CUT with ordered(l) >= u: 1 each (`top`: 0) or exp((l - top) / t) where ordered(l) >=
// `cut` (non-increasing in u); 32 halvings.
fn largest_cut(r: u32, masked: bool, want: f32, top: f32, inv_t: f32, cut: u32, i: u32) -> u32 {
    var lo = 0u;
    var hi = 0xffffffffu;
    for (var it = 0u; it < 32u; it++) {
        let d = hi - lo;
        let mid = lo + d / 2u + (d & 1u);
        var sum = 0.0;
        for (var t = i; t < p.n; t += WG) {
            let l = logit(r, t, masked);
            let o = ordered(l);
            if l > CUT && o >= mid && o >= cut {
                sum += select(exp((l - top) * inv_t), 1.0, inv_t == 0.0);
            }
        }
        if total(sum, i) >= want {
            lo = mid;
        } else {
            hi = mid - 1u;
        }
    }
    return lo;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let r = g.x;
    if i < 7u {
        row_params[i] = params[7u * r + i];
    }
    let q = workgroupUniformLoad(&row_params);
    let temperature = bitcast<f32>(q[0]);
    let min_p = bitcast<f32>(q[1]);
    let top_p = bitcast<f32>(q[2]);
    let top_k = q[3];
    let key = vec2<u32>(q[4], q[5]);
    let masked = q[6] != 0u;
    var v = CUT;
    var idx = NO_TOKEN;
    for (var t = i; t < p.n; t += WG) {
        let l = logit(r, t, masked);
        if l > v {
            v = l;
            idx = t;
        }
    }
    let top = best(v, idx, i);
    var token = top.y;
    if temperature > 0.0 {
        let m = bitcast<f32>(top.x);
        let inv_t = 1.0 / temperature;
        // Keep ordered(l) >= cut.
        var cut = 0u;
        if top_k > 0u && top_k < p.n {
            cut = largest_cut(r, masked, f32(top_k), 0.0, 0.0, 0u, i);
        }
        if top_p < 1.0 {
            var z = 0.0;
            for (var t = i; t < p.n; t += WG) {
                let l = logit(r, t, masked);
                if l > CUT && ordered(l) >= cut {
                    z += exp((l - m) * inv_t);
                }
            }
            let want = top_p * total(z, i);
            cut = max(cut, largest_cut(r, masked, want, m, inv_t, cut, i));
        }
        var floor = CUT;
        if min_p > 0.0 {
            floor = m + temperature * log(min_p);
        }
        var gv = CUT;
        var gi = NO_TOKEN;
        for (var t = i; t < p.n; t += WG) {
            let l = logit(r, t, masked);
            if l > CUT && l >= floor && ordered(l) >= cut {
                let noisy = l * inv_t - log(-log(uniform01(key, t)));
                if noisy > gv || gi == NO_TOKEN {
                    gv = noisy;
                    gi = t;
                }
            }
        }
        let drawn = best(gv, gi, i);
        if drawn.y != NO_TOKEN {
            token = drawn.y;
        }
    }
    if i == 0u {
        out[r] = select(token, 0u, token == NO_TOKEN);
    }
}
