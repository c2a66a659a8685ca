// y[m, off + n] (+)= sum_k x[m, k] * w[n, k]: f32 activations against weights as weights.wgsl
// stores them, in tiles of 64 rows of x by 64 rows of w through workgroup memory (w
// dequantized there, a block of 32 values per row and step of k); each thread keeps 4 x 4
// sums and reads its operands as vectors. `add`: into the residual stream.

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 32u;
// Both tiles k-major, four rows to a vector: [TK][TM / 4] and [TK][TN / 4].
var<workgroup> xs: array<vec4<f32>, 512>;
var<workgroup> ws: array<vec4<f32>, 512>;

fn put_x(kk: u32, r: u32, v: f32) {
    xs[kk * (TM / 4u) + r / 4u][r % 4u] = v;
}

fn put_w(kk: u32, r: u32, v: f32) {
    ws[kk * (TN / 4u) + r / 4u][r % 4u] = v;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) g: vec3<u32>, @builtin(local_invocation_index) i: u32) {
    let n0 = g.x * TN;
    let m0 = g.y * TM;
    // This thread's 4 rows of x (tm) and 4 rows of w (tn).
    let tn = i % 16u;
    let tm = i / 16u;
    let kw = f16_row_words(p.k);
    var acc: array<vec4<f32>, 4>;
    for (var k0 = 0u; k0 < p.k; k0 += TK) {
        for (var e = i; e < TM * TK; e += 256u) {
            let r = e / TK;
            let c = k0 + e % TK;
            var v = 0.0;
            if m0 + r < p.m && c < p.k {
                v = x[(m0 + r) * p.k + c];
            }
            put_x(e % TK, r, v);
        }
        // A quantized row's 32 values of this step are one block: 8 quads of values.
        for (var e = i; FMT != 0u && e < TN * 8u; e += 256u) {
            let r = e / 8u;
            let j = e % 8u;
            var q = vec4<f32>(0.0);
            if n0 + r < p.n {
                q = quad(block((n0 + r) * (p.k / 32u) + k0 / 32u, p.scales), j);
            }
            for (var t = 0u; t < 4u; t++) {
                put_w(4u * j + t, r, q[t]);
            }
        }
        for (var e = i; FMT == 0u && e < TN * TK / 2u; e += 256u) {
            let r = e / (TK / 2u);
            let c2 = e % (TK / 2u);
            let gc = k0 / 2u + c2;
            var v = vec2<f32>(0.0);
            if n0 + r < p.n && gc < kw {
                v = unpack2x16float(word((n0 + r) * kw + gc));
            }
            put_w(2u * c2, r, v.x);
            put_w(2u * c2 + 1u, r, v.y);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            let a = xs[kk * (TM / 4u) + tm];
            let b = ws[kk * (TN / 4u) + tn];
            for (var r = 0u; r < 4u; r++) {
                acc[r] += a[r] * b;
            }
        }
        workgroupBarrier();
    }
    for (var r = 0u; r < 4u; r++) {
        let row = m0 + 4u * tm + r;
        for (var j = 0u; j < 4u; j++) {
            let c = n0 + 4u * tn + j;
            if row < p.m && c < p.n {
                let at = row * p.ldy + p.off + c;
                var v = acc[r][j];
                if p.add != 0u {
                    v += y[at];
                }
                y[at] = v;
            }
        }
    }
}
