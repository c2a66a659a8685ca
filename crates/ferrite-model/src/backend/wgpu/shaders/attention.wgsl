// Paged varlen attention, one workgroup per (query head, token, split of the keys): the
// token's request found by binary search over cu_seqlens_q, its keys read through the
// request's block table 64 at a time (a thread per key, K read four values a load), an
// online softmax in f32 (a thread's share of the sum kept apart until the end), then V
// summed four dimensions a thread, the workgroup's threads split into groups that take
// every G-th key, the groups' sums added at the end. Prefill chunks, decodes and verify
// windows of one step in one launch. With one split the output is written; with more (a
// decode's few workgroups given more keys each), each split's maximum, sum and unnormalized
// output go to `out` for attention_combine.wgsl.

struct P {
    heads: u32,
    kv_heads: u32,
    block_size: u32,
    scale: f32,
    window: u32, // 0: none
    softcap: f32, // 0: none
    flags: u32, // 1 causal, 2 sinks, 4 f16 K/V, 8 int8 K/V (qkv.wgsl)
    v_at: u32,
    cu: u32,
    lens: u32,
    tables: u32,
    max_blocks: u32,
    seqs: u32,
    splits: u32,
    // The word where int8 K/V's scales start.
    scales: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> cache: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read> st: array<u32>;
@group(0) @binding(3) var<storage, read> sinks: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

// The head size, a multiple of 4 up to 512: a pipeline per size (attention.rs), so that the
// loops over a head's values unroll and keep their loads in flight together.
override D: u32 = 128u;
const WG: u32 = 64u;
var<workgroup> qs: array<vec4<f32>, D / 4u>;
var<workgroup> ps: array<f32, WG>;
var<workgroup> at: array<u32, WG>;
// Each subgroup's largest score of a chunk; then each thread's V sums, to add the groups'.
var<workgroup> maxima: array<f32, WG>;
var<workgroup> sums: array<vec4<f32>, 2u * WG>;
// The token's request and key range, read back as uniform values: the loop over keys holds
// barriers.
var<workgroup> span: vec3<u32>;

fn word(w: u32) -> u32 {
    return cache[w / 2u][w % 2u];
}

// An int8 row's scale: the row that element `base` starts (V's rows follow K's).
fn scale(base: u32) -> f32 {
    return bitcast<f32>(word(p.scales + base / D));
}

// Elements e..e+3 of K/V from element `base` on (base + e a multiple of 4).
fn kv4(base: u32, e: u32) -> vec4<f32> {
    let at = base + e;
    if (p.flags & 8u) != 0u {
        return vec4<f32>(unpack4xI8(word(at / 4u))) * scale(base);
    }
    if (p.flags & 4u) != 0u {
        let v = cache[at / 4u];
        return vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
    }
    return bitcast<vec4<f32>>(vec4<u32>(cache[at / 2u], cache[at / 2u + 1u]));
}

// Token t's request and the first and last key it sees.
fn request_span(t: u32) -> vec3<u32> {
    let lo = request_of(p.cu, p.seqs, t);
    let start = st[p.cu + lo];
    let q_len = st[p.cu + lo + 1u] - start;
    let len = st[p.lens + lo];
    let pos = len - q_len + (t - start);
    var first = 0u;
    var last = len - 1u;
    if (p.flags & 1u) != 0u {
        last = pos;
        if p.window > 0u && pos + 1u > p.window {
            first = pos + 1u - p.window;
        }
    }
    return vec3<u32>(lo, first, last);
}

// The largest of every thread's `s` (subgroups first, then theirs through `maxima`).
fn chunk_max(s: f32, sg: u32, sgs: u32, lane: u32) -> f32 {
    let v = subgroupMax(s);
    if lane == 0u {
        maxima[sg] = v;
    }
    workgroupBarrier();
    var m = maxima[0];
    for (var k = 1u; k < sgs; k++) {
        m = max(m, maxima[k]);
    }
    return m;
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) g: vec3<u32>,
    @builtin(local_invocation_index) i: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) sgs: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let h = g.x;
    let t = g.y;
    let split = g.z;
    // Quads of a head; threads that share a row of V, a quad each (two where a row has
    // more than WG); groups of those threads, each taking every `groups`-th key of a chunk.
    let quads = D / 4u;
    let vq = min(quads, WG);
    let groups = WG / vq;
    let group = i / vq;
    let c0 = i % vq;
    if i == 0u {
        span = request_span(t);
    }
    let sp = workgroupUniformLoad(&span);
    let b = sp.x;
    // This split's keys, lo..hi: whole chunks of WG.
    let per = ((sp.z + 1u - sp.y + p.splits - 1u) / p.splits + WG - 1u) / WG * WG;
    let lo = sp.y + split * per;
    let hi = min(sp.z + 1u, lo + per);
    let kvh = h / (p.heads / p.kv_heads);
    let row = (t * p.heads + h) * D;
    for (var e = i; e < D; e += WG) {
        qs[e / 4u][e % 4u] = q[row + e] * p.scale;
    }
    workgroupBarrier();
    var acc: array<vec4<f32>, 2>;
    var m = -3.0e38;
    // This thread's share of the softmax's sum.
    var l = 0.0;
    if (p.flags & 2u) != 0u && split == 0u {
        m = sinks[h];
        if i == 0u {
            l = 1.0;
        }
    }
    let stride = p.kv_heads * D;
    for (var j0 = lo; j0 < hi; j0 += WG) {
        let j = j0 + i;
        var s = -3.0e38;
        if j < hi {
            let block = st[p.tables + b * p.max_blocks + j / p.block_size];
            let base = (block * p.block_size + j % p.block_size) * stride + kvh * D;
            at[i] = base;
            var qk = 0.0;
            for (var c = 0u; c < quads; c++) {
                qk += dot(qs[c], kv4(base, 4u * c));
            }
            s = qk;
            if p.softcap > 0.0 {
                s = p.softcap * tanh(clamp(s / p.softcap, -15.0, 15.0));
            }
        }
        let m_new = max(m, chunk_max(s, sg, sgs, lane));
        let alpha = exp(m - m_new);
        var pj = 0.0;
        if j < hi {
            pj = exp(s - m_new);
        }
        ps[i] = pj;
        l = l * alpha + pj;
        m = m_new;
        workgroupBarrier();
        let n = min(WG, hi - j0);
        acc[0] *= alpha;
        acc[1] *= alpha;
        if group < groups {
            for (var jj = group; jj < WG; jj += groups) {
                if jj < n {
                    let base = p.v_at + at[jj];
                    let pv = ps[jj];
                    acc[0] += pv * kv4(base, 4u * c0);
                    if c0 + vq < quads {
                        acc[1] += pv * kv4(base, 4u * (c0 + vq));
                    }
                }
            }
        }
        workgroupBarrier();
    }
    l = total(l, i);
    // The groups' sums added into the first group's threads.
    sums[i] = acc[0];
    sums[WG + i] = acc[1];
    workgroupBarrier();
    if group != 0u {
        return;
    }
    for (var k = 1u; k < groups; k++) {
        acc[0] += sums[k * vq + c0];
        acc[1] += sums[WG + k * vq + c0];
    }
    if p.splits == 1u {
        out_quad(row, c0, acc[0] / l);
        if c0 + vq < quads {
            out_quad(row, c0 + vq, acc[1] / l);
        }
        return;
    }
    // This split's part: [maximum, sum, D unnormalized outputs].
    let part = ((t * p.heads + h) * p.splits + split) * (D + 2u);
    if i == 0u {
        out[part] = m;
        out[part + 1u] = l;
    }
    out_quad(part + 2u, c0, acc[0]);
    if c0 + vq < quads {
        out_quad(part + 2u, c0 + vq, acc[1]);
    }
}

fn out_quad(at: u32, c: u32, v: vec4<f32>) {
    for (var k = 0u; k < 4u; k++) {
        out[at + 4u * c + k] = v[k];
    }
}
