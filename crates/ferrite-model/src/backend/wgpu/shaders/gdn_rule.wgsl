// The gated delta rule and the output's gated RMSNorm, one workgroup per (request, value
// head) of WG threads, WG the value head size: thread j keeps column j of the head's
// [DK, WG] state matrix S in registers and walks the request's tokens in order: S *= decay,
// delta = (v - S^T k) beta, S += k delta^T, o = S^T q, with q and k L2-normed (q times
// 1/sqrt(DK)); then out = rms_norm(o) * norm * silu(z). The recurrent form for every step: a
// prefill chunk is walked token by token. `y` [T, conv_dim]: the convolution's output
// (gdn.wgsl); `proj` [T, width]: Q | K | V, z [v_heads * WG], b [v_heads], a [v_heads]. With
// saves, the state after a request's first n tokens also goes to its checkpoint slot; with
// drafts, the state after each draft token.

struct P {
    cu: u32,
    positions: u32,
    slots: u32,
    saves: u32,
    drafts: u32,
    width: u32,
    elems: u32,
    conv_dim: u32,
    taps: u32,
    nk: u32,
    nv: u32,
    eps: f32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> st: array<u32>;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> proj: array<f32>;
@group(0) @binding(3) var<storage, read> a_log: array<f32>;
@group(0) @binding(4) var<storage, read> dt_bias: array<f32>;
@group(0) @binding(5) var<storage, read> norm: array<f32>;
@group(0) @binding(6) var<storage, read_write> state: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;

// The key head size, and the value head size: a thread per column (powers of two).
override DK: u32 = 128u;
override WG: u32 = 128u;
const MAX_DK: u32 = 128u;
const NONE: u32 = 0xffffffffu;

var<workgroup> qs: array<f32, DK>;
var<workgroup> ks: array<f32, DK>;
// The request's rows and where its state goes, read back as uniform values: the loop over
// tokens holds barriers.
var<workgroup> span: vec2<u32>;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

// torch's softplus (linear past 20).
fn softplus(v: f32) -> f32 {
    return select(log(1.0 + exp(v)), v, v > 20.0);
}

// S (DK values) to `to`'s column j.
fn store(s: ptr<function, array<f32, MAX_DK>>, to: u32, j: u32) {
    for (var e = 0u; e < DK; e++) {
        state[to + e * WG + j] = (*s)[e];
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) j: u32) {
    let i = g.x;
    let h = g.y;
    if j == 0u {
        span = vec2<u32>(st[p.cu + i], st[p.cu + i + 1u]);
    }
    let rows = workgroupUniformLoad(&span);
    let r0 = rows.x;
    if r0 == rows.y {
        return;
    }
    let kd = p.nk * DK;
    let vd = p.nv * WG;
    let kh = h / (p.nv / p.nk);
    let head = p.conv_dim * (p.taps - 1u) + h * DK * WG;
    let own = st[p.slots + i] * p.elems + head;
    var save_at = NONE;
    var save = 0u;
    if p.saves != NONE && st[p.saves + 2u * i + 1u] != NONE {
        save_at = r0 + st[p.saves + 2u * i] - 1u;
        save = st[p.saves + 2u * i + 1u] * p.elems + head;
    }
    // A verify step: the state after each row src draft_from on (but the last) to its slot.
    var draft_from = rows.y;
    var drafts = 0u;
    if p.drafts != NONE && st[p.drafts + 2u * i + 1u] != NONE {
        draft_from = r0 + st[p.drafts + 2u * i] - 1u;
        drafts = st[p.drafts + 2u * i + 1u];
    }
    var s: array<f32, MAX_DK>;
    let restart = st[p.positions + r0] == 0u;
    for (var e = 0u; e < DK; e++) {
        s[e] = select(state[own + e * WG + j], 0.0, restart);
    }
    let decay_rate = exp(a_log[h]);
    let dt = dt_bias[h];
    let scale = inverseSqrt(f32(DK));
    for (var t = r0; t < rows.y; t++) {
        let row = t * p.conv_dim;
        var qq = 0.0;
        var kk = 0.0;
        for (var e = j; e < DK; e += WG) {
            let a = y[row + kh * DK + e];
            let b = y[row + kd + kh * DK + e];
            qs[e] = a;
            ks[e] = b;
            qq += a * a;
            kk += b * b;
        }
        let qn = inverseSqrt(total(qq, j) + 1e-6) * scale;
        let kn = inverseSqrt(total(kk, j) + 1e-6);
        let v = y[row + 2u * kd + h * WG + j];
        let gates = t * p.width + p.conv_dim + vd;
        let beta = 1.0 / (1.0 + exp(-proj[gates + h]));
        let decay = exp(-decay_rate * softplus(proj[gates + p.nv + h] + dt));
        var mem = 0.0;
        for (var e = 0u; e < DK; e++) {
            s[e] *= decay;
            mem += s[e] * ks[e];
        }
        let delta = (v - mem * kn) * beta * kn;
        var o = 0.0;
        for (var e = 0u; e < DK; e++) {
            s[e] += ks[e] * delta;
            o += s[e] * qs[e];
        }
        o *= qn;
        if t == save_at {
            store(&s, save, j);
        }
        if t >= draft_from && t + 1u < rows.y {
            store(&s, (drafts + t - draft_from) * p.elems + head, j);
        }
        let inv = inverseSqrt(total(o * o, j) / f32(WG) + p.eps);
        let z = proj[t * p.width + p.conv_dim + h * WG + j];
        out[t * vd + h * WG + j] = o * inv * norm[j] * silu(z);
    }
    store(&s, own, j);
}
