// y[m, off + n] (+)= sum_k x[m, k] * w[n, k] for a few rows of x (decodes), w as weights.wgsl
// stores it, read in blocks (f16 rows: of 8 values, where a row is whole vectors). A subgroup
// takes R rows of w at once: each lane loads 4 blocks (of those rows, `size` blocks apart)
// before it sums them, so that loads are in flight together, and each load of x serves the
// R rows. Sums across lanes with subgroupAdd (any subgroup size: 8 on lavapipe, 32 on Apple
// and NVIDIA, 64 on AMD). `add`: into the residual stream. With `div` set (a mixture of
// experts, M = 1): workgroup z takes pair row0 + z, whose expert `ids[pair]` picks w's rows
// and whose row of x is pair / div; y has a row per pair. Fused (linear_params.wgsl), a
// decode's RMSNorm and gated activation cost no launch of their own: each x value is loaded
// by one lane of the subgroup, which sums its square too, and the norm's scale multiplies the
// sums at the end (W (x g) / rms(x)); gated, a subgroup's rows are R / 2 gate rows and the up
// rows p.n / 2 below them.

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> ids: array<u32>;
@group(0) @binding(4) var<storage, read> gamma: array<vec4<f32>>;

// Rows of x: a pipeline per count up to 8 (linear.rs), so that the loops over them unroll.
override M: u32 = 1u;
// Rows of w a subgroup takes at once: 1, 2 or 4 (2 or 4 gated).
override R: u32 = 2u;
// Rows of w per workgroup (linear.rs launches a workgroup per ROWS of them, or of ROWS / 2
// rows of y gated): a subgroup's R on GPUs, more on CPU drivers, which schedule each
// workgroup at a cost.
override ROWS: u32 = 4u;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) g: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) sgs: u32,
    @builtin(subgroup_size) size: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    // Rows of y a subgroup takes at once and in all, and how far below a gate row its up
    // row is.
    let per = select(R, R / 2u, p.gated != 0u);
    let outs = select(p.n, p.n / 2u, p.gated != 0u);
    let half = p.n / 2u;
    let first = (g.y * 65535u + g.x) * (ROWS / R * per);
    // The first rows of x, y and w.
    var xr = p.row0;
    var yr = p.row0;
    var wr = 0u;
    if p.div != 0u {
        let pair = p.row0 + g.z;
        xr = pair / p.div;
        yr = pair;
        wr = ids[pair] * p.n;
    }
    let vals = block_values();
    let nb = p.k / vals;
    let quads = vals / 4u;
    // Blocks of one row a lane loads at once.
    let u = 4u / R;
    for (var n0 = first + sg * per; n0 < min(first + ROWS / R * per, outs); n0 += sgs * per) {
        var acc: array<vec4<f32>, 8>;
        // Sums of squares of x's rows, for the norm.
        var ss: array<f32, 8>;
        for (var b0 = lane; b0 < nb; b0 += u * size) {
            var blk: array<Block, 4>;
            for (var t = 0u; t < 4u; t++) {
                let i = t % R;
                let b = b0 + t / R * size;
                if n0 + i % per < outs && b < nb {
                    let n = n0 + i % per + i / per * half;
                    blk[t] = block((wr + n) * nb + b, p.scales);
                }
            }
            for (var v = 0u; v < u; v++) {
                let b = b0 + v * size;
                // Each half of a block summed on its codes, then scaled and offset once
                // (weights.wgsl's affine: Q6_K scales its halves apart).
                for (var hf = 0u; hf < 2u && b < nb; hf++) {
                    var s: array<vec4<f32>, 8>;
                    var xsum: array<f32, 8>;
                    for (var j = hf * quads / 2u; j < (hf + 1u) * quads / 2u; j++) {
                        var wq: array<vec4<f32>, 4>;
                        for (var i = 0u; i < R; i++) {
                            wq[i] = codes(blk[v * R + i], j);
                        }
                        let c = (b * vals + 4u * j) / 4u;
                        var gc = vec4<f32>(1.0);
                        if p.norm != 0u {
                            gc = gamma[c];
                        }
                        for (var r = 0u; r < M; r++) {
                            let xv = x[(xr + r) * (p.k / 4u) + c];
                            if p.norm != 0u {
                                ss[r] += dot(xv, xv);
                            }
                            let xg = xv * gc;
                            xsum[r] += xg.x + xg.y + xg.z + xg.w;
                            for (var i = 0u; i < R; i++) {
                                s[r][i] += dot(wq[i], xg);
                            }
                        }
                    }
                    for (var i = 0u; i < R; i++) {
                        let a = affine(blk[v * R + i], 4u * hf);
                        for (var r = 0u; r < M; r++) {
                            acc[r][i] += a.x * s[r][i] + a.y * xsum[r];
                        }
                    }
                }
            }
        }
        var sums: array<vec4<f32>, 8>;
        var scale: array<f32, 8>;
        for (var r = 0u; r < M; r++) {
            sums[r] = subgroupAdd(acc[r]);
            scale[r] = 1.0;
            if p.norm != 0u {
                scale[r] = inverseSqrt(subgroupAdd(ss[r]) / f32(p.k) + p.eps);
            }
        }
        // M x per outputs: more than a subgroup of 8 has lanes.
        for (var o = lane; o < M * per; o += size) {
            let r = o / per;
            let i = o % per;
            let n = n0 + i;
            if n < outs {
                let at = (yr + r) * p.ldy + p.off + n;
                var v = sums[r][i] * scale[r];
                if p.gated != 0u {
                    v = gate_activation(p.gated - 1u, v) * sums[r][i + per] * scale[r];
                }
                if p.add != 0u {
                    v += y[at];
                }
                y[at] = v;
            }
        }
    }
}
