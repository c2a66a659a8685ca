// y[m, off + n] (+)= sum_k x[m, k] * w[n, k]: f32 activations against weights as weights.wgsl
// stores them (dequantized into workgroup memory), in tiles of 32 rows x 64 outputs through workgroup memory; each thread
// keeps 2 x 4 sums. `add`: into the residual stream.

struct P {
    m: u32,
    n: u32,
    k: u32,
    ldy: u32,
    off: u32,
    add: u32,
    row0: u32,
    // The word where a quantized part's block scales start.
    scales: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

const TM: u32 = 32u;
const TN: u32 = 64u;
const TK: u32 = 32u;
var<workgroup> xs: array<f32, 1024>; // [TM][TK]
var<workgroup> ws: array<f32, 2048>; // [TK][TN]

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let n0 = g.x * TN;
    let m0 = g.y * TM;
    let tn = i % 16u;
    let tm = i / 16u;
    let kw = f16_row_words(p.k);
    var acc: array<f32, 8>;
    for (var k0 = 0u; k0 < p.k; k0 += TK) {
        for (var e = i; e < TM * TK; e += 256u) {
            let r = m0 + e / TK;
            let c = k0 + e % TK;
            var v = 0.0;
            if r < p.m && c < p.k {
                v = x[r * p.k + c];
            }
            xs[e] = v;
        }
        // A quantized row's 32 values of this tile are one block: 8 quads of values.
        for (var e = i; FMT != 0u && e < TN * 8u; e += 256u) {
            let r = e / 8u;
            let j = e % 8u;
            var q = vec4<f32>(0.0);
            if n0 + r < p.n {
                q = quad(block((n0 + r) * (p.k / 32u) + k0 / 32u, p.scales), j);
            }
            for (var t = 0u; t < 4u; t++) {
                ws[(4u * j + t) * TN + r] = q[t];
            }
        }
        for (var e = i; FMT == 0u && e < TN * TK / 2u; e += 256u) {
            let r = e / (TK / 2u);
            let c2 = e % (TK / 2u);
            let gr = n0 + r;
            let gc = k0 / 2u + c2;
            var v = vec2<f32>(0.0);
            if gr < p.n && gc < kw {
                v = unpack2x16float(word(gr * kw + gc));
            }
            ws[2u * c2 * TN + r] = v.x;
            ws[(2u * c2 + 1u) * TN + r] = v.y;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            let a0 = xs[2u * tm * TK + kk];
            let a1 = xs[(2u * tm + 1u) * TK + kk];
            for (var j = 0u; j < 4u; j++) {
                let b = ws[kk * TN + 4u * tn + j];
                acc[j] += a0 * b;
                acc[4u + j] += a1 * b;
            }
        }
        workgroupBarrier();
    }
    for (var rr = 0u; rr < 2u; rr++) {
        let r = m0 + 2u * tm + rr;
        for (var j = 0u; j < 4u; j++) {
            let c = n0 + 4u * tn + j;
            if r < p.m && c < p.n {
                let at = r * p.ldy + p.off + c;
                var v = acc[4u * rr + j];
                if p.add != 0u {
                    v += y[at];
                }
                y[at] = v;
            }
        }
    }
}
