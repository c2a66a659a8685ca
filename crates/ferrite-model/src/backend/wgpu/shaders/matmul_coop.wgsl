// y[m, off + n] (+)= sum_k x[m, k] * w[n, k] on cooperative matrices (tensor cores), where the
// adapter multiplies 16 x 16 f16 tiles into f32 sums and runs subgroups of 32 lanes: tiles
// of 128 rows of x by 128 rows of w, eight subgroups each taking 32 x 64 of them (eight
// sums of 16 x 16). The operands go through workgroup memory as f16 (x rounded, w
// dequantized as weights.wgsl stores it), 32 values of k a step: a thread loads its share
// of the next step (x four values a load; w a block, or 16 f16 values, per two threads)
// into registers while the subgroups multiply this one. Each subgroup's sums go out
// through a 16 x 16 patch of workgroup memory, where the edges and `add` (into the residual
// stream) are handled. k is a multiple of 4 (linear.rs).

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

const TM: u32 = 128u;
const TN: u32 = 128u;
const TK: u32 = 32u;
// Rows of the operand tiles, padded so that a tile's 16 rows fall on different banks.
const S: u32 = 40u;
// Row-major tiles: x's [TM][S], w's [TN][S]; a 16 x 16 patch of sums per subgroup.
var<workgroup> xs: array<f16, 5120>;
var<workgroup> ws: array<f16, 5120>;
var<workgroup> ys: array<f32, 2048>;

// A thread's share of one step: x's four vectors, w's four quads of values.
struct Share {
    x: array<vec4<f32>, 4>,
    w: array<vec4<f32>, 4>,
}

fn load(m0: u32, n0: u32, k0: u32, i: u32) -> Share {
    var s: Share;
    let k4 = p.k / 4u;
    for (var t = 0u; t < 4u; t++) {
        let e = i + 256u * t;
        let r = m0 + e / 8u;
        let c = k0 / 4u + e % 8u;
        s.x[t] = vec4<f32>(0.0);
        if r < p.m && c < k4 {
            s.x[t] = x[r * k4 + c];
        }
    }
    // Two threads a row of w: quads h, h + 2, h + 4, h + 6 of its block of the step, or f16
    // words 8h .. 8h + 7.
    let r = n0 + i / 2u;
    let h = i % 2u;
    if r >= p.n {
        return s;
    }
    if FMT != 0u {
        let b = block(r * (p.k / 32u) + k0 / 32u, p.scales);
        for (var t = 0u; t < 4u; t++) {
            s.w[t] = quad(b, h + 2u * t);
        }
        return s;
    }
    let kw = f16_row_words(p.k);
    for (var t = 0u; t < 4u; t++) {
        let c = k0 / 2u + 8u * h + 2u * t;
        var v = vec4<f32>(0.0);
        if c < kw {
            v = vec4<f32>(unpack2x16float(word(r * kw + c)), 0.0, 0.0);
        }
        if c + 1u < kw {
            v = vec4<f32>(v.xy, unpack2x16float(word(r * kw + c + 1u)));
        }
        s.w[t] = v;
    }
    return s;
}

fn store(s: Share, i: u32) {
    for (var t = 0u; t < 4u; t++) {
        let e = i + 256u * t;
        let at = (e / 8u) * S + 4u * (e % 8u);
        for (var q = 0u; q < 4u; q++) {
            xs[at + q] = f16(s.x[t][q]);
        }
    }
    let h = i % 2u;
    for (var t = 0u; t < 4u; t++) {
        // Quad h + 2t of a block; or f16 values 16h + 4t ...
        var c = 4u * (h + 2u * t);
        if FMT == 0u {
            c = 16u * h + 4u * t;
        }
        let at = (i / 2u) * S + c;
        for (var q = 0u; q < 4u; q++) {
            ws[at + q] = f16(s.w[t][q]);
        }
    }
}

// One subgroup's 16 x 16 sums at rows r0.., columns c0.. of y, through its patch.
fn put(c: coop_mat16x16<f32, C>, r0: u32, c0: u32, sg: u32, lane: u32) {
    coopStoreT(c, &ys[256u * sg], 16u);
    workgroupBarrier();
    for (var e = lane; e < 256u; e += 32u) {
        let r = r0 + e / 16u;
        let col = c0 + e % 16u;
        if r < p.m && col < p.n {
            let o = r * p.ldy + p.off + col;
            var v = ys[256u * sg + e];
            if p.add != 0u {
                v += y[o];
            }
            y[o] = v;
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) g: vec3<u32>,
    @builtin(local_invocation_index) i: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let n0 = g.x * TN;
    let m0 = g.y * TM;
    // This subgroup's 32 rows of x and 64 rows of w in the tile.
    let am = 32u * (sg % 4u);
    let bn = 64u * (sg / 4u);
    var c00: coop_mat16x16<f32, C>;
    var c01: coop_mat16x16<f32, C>;
    var c02: coop_mat16x16<f32, C>;
    var c03: coop_mat16x16<f32, C>;
    var c10: coop_mat16x16<f32, C>;
    var c11: coop_mat16x16<f32, C>;
    var c12: coop_mat16x16<f32, C>;
    var c13: coop_mat16x16<f32, C>;
    var next = load(m0, n0, 0u, i);
    for (var k0 = 0u; k0 < p.k; k0 += TK) {
        store(next, i);
        workgroupBarrier();
        if k0 + TK < p.k {
            next = load(m0, n0, k0 + TK, i);
        }
        for (var kk = 0u; kk < TK; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&xs[am * S + kk], S);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&xs[(am + 16u) * S + kk], S);
            // w's rows are B's columns: column-major loads.
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&ws[bn * S + kk], S);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&ws[(bn + 16u) * S + kk], S);
            let b2 = coopLoad<coop_mat16x16<f16, B>>(&ws[(bn + 32u) * S + kk], S);
            let b3 = coopLoad<coop_mat16x16<f16, B>>(&ws[(bn + 48u) * S + kk], S);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c02 = coopMultiplyAdd(a0, b2, c02);
            c03 = coopMultiplyAdd(a0, b3, c03);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c12 = coopMultiplyAdd(a1, b2, c12);
            c13 = coopMultiplyAdd(a1, b3, c13);
        }
        workgroupBarrier();
    }
    let r0 = m0 + am;
    let col = n0 + bn;
    put(c00, r0, col, sg, lane);
    put(c01, r0, col + 16u, sg, lane);
    put(c02, r0, col + 32u, sg, lane);
    put(c03, r0, col + 48u, sg, lane);
    put(c10, r0 + 16u, col, sg, lane);
    put(c11, r0 + 16u, col + 16u, sg, lane);
    put(c12, r0 + 16u, col + 32u, sg, lane);
    put(c13, r0 + 16u, col + 48u, sg, lane);
}
