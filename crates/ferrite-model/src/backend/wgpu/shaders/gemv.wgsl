// y[m, off + n] (+)= sum_k x[m, k] * w[n, k] for a few rows of x (decodes), w as weights.wgsl
// stores it, read in blocks (f16 rows: of 8 values, where a row is whole vectors). A subgroup
// takes R rows of w at once: each lane loads 4 blocks (of those rows, `size` blocks apart)
// before it sums them, so that loads are in flight together, and each load of x serves the
// R rows. Sums across lanes with subgroupAdd (any subgroup size: 8 on lavapipe, 32 on Apple
// and NVIDIA, 64 on AMD). `add`: into the residual stream. With `div` set (a mixture of
// experts, M = 1): workgroup z takes pair row0 + z, whose expert `ids[pair]` picks w's rows
// and whose row of x is pair / div; y has a row per pair.

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> ids: array<u32>;

// Rows of x: a pipeline per count up to 8 (linear.rs), so that the loops over them unroll.
override M: u32 = 1u;
// Rows of w a subgroup takes at once: 1, 2 or 4.
override R: u32 = 2u;
// Rows of w per workgroup (linear.rs launches n / ROWS workgroups): a subgroup's R on GPUs,
// more on CPU drivers, which schedule each workgroup at a cost.
override ROWS: u32 = 4u;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) g: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) sgs: u32,
    @builtin(subgroup_size) size: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let first = (g.y * 65535u + g.x) * ROWS;
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
    for (var n0 = first + sg * R; n0 < min(first + ROWS, p.n); n0 += sgs * R) {
        var acc: array<vec4<f32>, 8>;
        for (var b0 = lane; b0 < nb; b0 += u * size) {
            var blk: array<Block, 4>;
            for (var t = 0u; t < 4u; t++) {
                let n = n0 + t % R;
                let b = b0 + t / R * size;
                if n < p.n && b < nb {
                    blk[t] = block((wr + n) * nb + b, p.scales);
                }
            }
            for (var v = 0u; v < u; v++) {
                let b = b0 + v * size;
                for (var j = 0u; j < quads && b < nb; j++) {
                    var wq: array<vec4<f32>, 4>;
                    for (var i = 0u; i < R; i++) {
                        wq[i] = quad(blk[v * R + i], j);
                    }
                    let c = (b * vals + 4u * j) / 4u;
                    for (var r = 0u; r < M; r++) {
                        let xv = x[(xr + r) * (p.k / 4u) + c];
                        for (var i = 0u; i < R; i++) {
                            acc[r][i] += dot(wq[i], xv);
                        }
                    }
                }
            }
        }
        var sums: array<vec4<f32>, 8>;
        for (var r = 0u; r < M; r++) {
            sums[r] = subgroupAdd(acc[r]);
        }
        // M x R sums: more than a subgroup of 8 has lanes.
        for (var o = lane; o < M * R; o += size) {
            let n = n0 + o % R;
            if n < p.n {
                let at = (yr + o / R) * p.ldy + p.off + n;
                var v = sums[o / R][o % R];
                if p.add != 0u {
                    v += y[at];
                }
                y[at] = v;
            }
        }
    }
}
