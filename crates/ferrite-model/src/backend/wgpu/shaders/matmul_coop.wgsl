// y[m, off + n] (+)= sum_k x[m, k] * w[n, k] on cooperative matrices (tensor cores), where the
// adapter multiplies 16 x 16 f16 tiles into f32 sums and runs subgroups of 32 lanes: tiles
// of 64 rows of x by 64 rows of w, the operands in workgroup memory as f16 (x rounded, w
// dequantized as weights.wgsl stores it, 32 values of k a step), four subgroups each taking
// 16 rows of x against the 64 rows of w. The sums go through workgroup memory to y, where
// the edges and `add` (into the residual stream) are handled.

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 32u;
// Row-major tiles: x's [TM][TK], w's [TN][TK], the sums' [TM][TN].
var<workgroup> xs: array<f16, 2048>;
var<workgroup> ws: array<f16, 2048>;
var<workgroup> ys: array<f32, 4096>;

@compute @workgroup_size(128)
fn main(
    @builtin(workgroup_id) g: vec3<u32>,
    @builtin(local_invocation_index) i: u32,
    @builtin(subgroup_id) sg: u32,
) {
    let n0 = g.x * TN;
    let m0 = g.y * TM;
    let kw = f16_row_words(p.k);
    var c0: coop_mat16x16<f32, C>;
    var c1: coop_mat16x16<f32, C>;
    var c2: coop_mat16x16<f32, C>;
    var c3: coop_mat16x16<f32, C>;
    for (var k0 = 0u; k0 < p.k; k0 += TK) {
        for (var e = i; e < TM * TK; e += 128u) {
            let r = m0 + e / TK;
            let c = k0 + e % TK;
            var v = 0.0;
            if r < p.m && c < p.k {
                v = x[r * p.k + c];
            }
            xs[e] = f16(v);
        }
        // A quantized row's 32 values of this step are one block: 8 quads of values.
        for (var e = i; FMT != 0u && e < TN * 8u; e += 128u) {
            let r = e / 8u;
            let j = e % 8u;
            var q = vec4<f32>(0.0);
            if n0 + r < p.n {
                q = quad(block((n0 + r) * (p.k / 32u) + k0 / 32u, p.scales), j);
            }
            for (var t = 0u; t < 4u; t++) {
                ws[r * TK + 4u * j + t] = f16(q[t]);
            }
        }
        for (var e = i; FMT == 0u && e < TN * TK / 2u; e += 128u) {
            let r = e / (TK / 2u);
            let c = e % (TK / 2u);
            var v = vec2<f32>(0.0);
            if n0 + r < p.n && k0 / 2u + c < kw {
                v = unpack2x16float(word((n0 + r) * kw + k0 / 2u + c));
            }
            ws[r * TK + 2u * c] = f16(v.x);
            ws[r * TK + 2u * c + 1u] = f16(v.y);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk += 16u) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&xs[16u * sg * TK + kk], TK);
            // w's rows are B's columns: column-major loads.
            c0 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&ws[kk], TK), c0);
            c1 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&ws[16u * TK + kk], TK), c1);
            c2 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&ws[32u * TK + kk], TK), c2);
            c3 = coopMultiplyAdd(a, coopLoad<coop_mat16x16<f16, B>>(&ws[48u * TK + kk], TK), c3);
        }
        workgroupBarrier();
    }
    let at = 16u * sg * TN;
    coopStoreT(c0, &ys[at], TN);
    coopStoreT(c1, &ys[at + 16u], TN);
    coopStoreT(c2, &ys[at + 32u], TN);
    coopStoreT(c3, &ys[at + 48u], TN);
    workgroupBarrier();
    for (var e = i; e < TM * TN; e += 128u) {
        let r = m0 + e / TN;
        let c = n0 + e % TN;
        if r < p.m && c < p.n {
            let o = r * p.ldy + p.off + c;
            var v = ys[e];
            if p.add != 0u {
                v += y[o];
            }
            y[o] = v;
        }
    }
}
