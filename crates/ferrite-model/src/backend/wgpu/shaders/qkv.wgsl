// Q/K/V preparation, one workgroup per (token, head of Q|K|V): bias, per-head RMSNorm of Q and
// K, rotary embedding of the first `2 half` dimensions of Q and K, then Q to `q` and K/V into
// the paged cache at the token's slot. The cache is K for every slot, then V (from element
// `v_at` on); `format` 0: f32 words, 1: f16 packed two to a word, 2: int8 codes four to a
// word, round(x / scale) with scale = amax / 127 per token and KV head, the scales from word
// `scales` on (K's rows, then V's).

struct P {
    heads: u32,
    kv_heads: u32,
    d: u32,
    half: u32,
    neox: u32,
    flags: u32, // 1 bias, 2 Q norm, 4 K norm
    eps: f32,
    positions: u32,
    slots: u32,
    sin_at: u32,
    v_at: u32,
    format: u32,
    scales: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
@group(0) @binding(1) var<storage, read> bias: array<f32>;
@group(0) @binding(2) var<storage, read> q_norm: array<f32>;
@group(0) @binding(3) var<storage, read> k_norm: array<f32>;
@group(0) @binding(4) var<storage, read> rope: array<f32>;
@group(0) @binding(5) var<storage, read> st: array<u32>;
@group(0) @binding(6) var<storage, read_write> q: array<f32>;
@group(0) @binding(7) var<storage, read_write> cache: array<u32>;

const WG: u32 = 64u;
const NO_SLOT: u32 = 0xffffffffu;
var<workgroup> val: array<f32, 512>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let head = g.x;
    let t = g.y;
    let d = p.d;
    let width = (p.heads + 2u * p.kv_heads) * d;
    let col = head * d;
    let is_q = head < p.heads;
    let is_k = !is_q && head < p.heads + p.kv_heads;
    for (var e = i; e < d; e += WG) {
        var v = qkv[t * width + col + e];
        if (p.flags & 1u) != 0u {
            v += bias[col + e];
        }
        val[e] = v;
    }
    workgroupBarrier();
    let qn = is_q && (p.flags & 2u) != 0u;
    let kn = is_k && (p.flags & 4u) != 0u;
    if qn || kn {
        var ss = 0.0;
        for (var e = i; e < d; e += WG) {
            ss += val[e] * val[e];
        }
        let inv = inverseSqrt(total(ss, i) / f32(d) + p.eps);
        for (var e = i; e < d; e += WG) {
            var w = k_norm[e];
            if is_q {
                w = q_norm[e];
            }
            val[e] *= inv * w;
        }
        workgroupBarrier();
    }
    if (is_q || is_k) && p.half > 0u {
        let pos = st[p.positions + t];
        // Each thread rotates whole pairs: read both, then write both.
        var rot: array<vec2<f32>, 4>;
        var n = 0u;
        for (var e = i; e < p.half; e += WG) {
            let c = rope[pos * p.half + e];
            let s = rope[p.sin_at + pos * p.half + e];
            var a = 2u * e;
            var b = 2u * e + 1u;
            if p.neox != 0u {
                a = e;
                b = e + p.half;
            }
            rot[n] = vec2<f32>(val[a] * c - val[b] * s, val[a] * s + val[b] * c);
            n++;
        }
        workgroupBarrier();
        n = 0u;
        for (var e = i; e < p.half; e += WG) {
            var a = 2u * e;
            var b = 2u * e + 1u;
            if p.neox != 0u {
                a = e;
                b = e + p.half;
            }
            val[a] = rot[n].x;
            val[b] = rot[n].y;
            n++;
        }
        workgroupBarrier();
    }
    if is_q {
        for (var e = i; e < d; e += WG) {
            q[(t * p.heads + head) * d + e] = val[e];
        }
        return;
    }
    // An int8 row's scale, before the slot is read (the maximum holds barriers).
    var scale = 0.0;
    if p.format == 2u {
        var m = 0.0;
        for (var e = i; e < d; e += WG) {
            m = max(m, abs(val[e]));
        }
        scale = largest(m, i) / 127.0;
    }
    let slot = st[p.slots + t];
    if slot == NO_SLOT {
        return;
    }
    var kvh = head - p.heads;
    var base = 0u;
    if !is_k {
        kvh -= p.kv_heads;
        base = p.v_at;
    }
    let row = slot * p.kv_heads + kvh;
    let at = row * d;
    if p.format == 2u {
        for (var e = i; e < d / 4u; e += WG) {
            let v = vec4<f32>(val[4u * e], val[4u * e + 1u], val[4u * e + 2u], val[4u * e + 3u]);
            var c = vec4<i32>(0);
            if scale > 0.0 {
                c = vec4<i32>(clamp(round(v / scale), vec4<f32>(-127.0), vec4<f32>(127.0)));
            }
            cache[(base + at) / 4u + e] = pack4xI8(c);
        }
        if i == 0u {
            cache[p.scales + base / d + row] = bitcast<u32>(scale);
        }
    } else if p.format == 1u {
        for (var e = i; e < d / 2u; e += WG) {
            cache[(base + at) / 2u + e] = pack2x16float(vec2<f32>(val[2u * e], val[2u * e + 1u]));
        }
    } else {
        for (var e = i; e < d; e += WG) {
            cache[base + at + e] = bitcast<u32>(val[e]);
        }
    }
}
