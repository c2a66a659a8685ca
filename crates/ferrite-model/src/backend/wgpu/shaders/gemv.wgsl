// y[m, off + n] (+)= sum_k x[m, k] * w[n, k] for a few rows of x (decodes), w as weights.wgsl
// stores it: each subgroup takes rows of w in turn, reading each once, coalesced, for every
// row of x, and sums with subgroupAdd (any subgroup size: 8 on lavapipe, 32 on Apple and NVIDIA, 64 on AMD). A
// workgroup takes 16 rows of w: few workgroups, which CPU drivers schedule at a cost each.
// `add`: into the residual stream.

struct P {
    m: u32,
    n: u32,
    k: u32,
    ldy: u32,
    off: u32,
    add: u32,
    // The first row of x and y (a step's rows taken 8 at a time).
    row0: u32,
    // The word where a quantized part's block scales start.
    scales: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

// Rows of w per workgroup (linear.rs launches n / ROWS workgroups).
const ROWS: u32 = 16u;
// Rows of x: a pipeline per count up to 8 (linear.rs), so that the loops over them unroll.
override M: u32 = 1u;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) g: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) sgs: u32,
    @builtin(subgroup_size) size: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let first = (g.y * 65535u + g.x) * ROWS;
    let kw = f16_row_words(p.k);
    let nb = p.k / 32u;
    for (var n = first + sg; n < min(first + ROWS, p.n); n += sgs) {
        var acc0 = vec4<f32>(0.0);
        var acc1 = vec4<f32>(0.0);
        // Quantized rows: each lane takes whole blocks of 32 values.
        for (var b = lane; FMT != 0u && b < nb; b += size) {
            let blk = block(n * nb + b, p.scales);
            for (var j = 0u; j < 8u; j++) {
                let wq = quad(blk, j);
                let c = 32u * b + 4u * j;
                for (var r = 0u; r < M; r++) {
                    let v = dot(wq, x[((p.row0 + r) * p.k + c) / 4u]);
                    if r < 4u {
                        acc0[r] += v;
                    } else {
                        acc1[r - 4u] += v;
                    }
                }
            }
        }
        for (var c2 = lane; FMT == 0u && c2 < kw; c2 += size) {
            let wv = unpack2x16float(word(n * kw + c2));
            let c = 2u * c2;
            let pair = c + 1u < p.k;
            for (var r = 0u; r < M; r++) {
                let xr = (p.row0 + r) * p.k + c;
                var v = wv.x * x[xr / 4u][xr % 4u];
                if pair {
                    v += wv.y * x[(xr + 1u) / 4u][(xr + 1u) % 4u];
                }
                if r < 4u {
                    acc0[r] += v;
                } else {
                    acc1[r - 4u] += v;
                }
            }
        }
        let s0 = subgroupAdd(acc0);
        let s1 = subgroupAdd(acc1);
        if lane < M {
            var v = s0[min(lane, 3u)];
            if lane >= 4u {
                v = s1[lane - 4u];
            }
            let at = (p.row0 + lane) * p.ldy + p.off + n;
            if p.add != 0u {
                v += y[at];
            }
            y[at] = v;
        }
    }
}
