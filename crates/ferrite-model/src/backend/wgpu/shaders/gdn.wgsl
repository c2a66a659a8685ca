// Gated delta-net layers (Qwen3.5, Qwen3-Next linear attention), before the delta rule
// (gdn_rule.wgsl): a prefix-cache hit's state restored, the causal convolution, its window's
// slide. A request's state, in its slot of `state` ([slots, elems] f32): the convolution's
// last K - 1 inputs ([K - 1, conv_dim], oldest first), then the rule's matrix per value head.
// The projection `proj` [T, width] starts with Q | K | V, the convolution's channels. `st`:
// the step's words; cu_seqlens, positions, state slots, restores and saves at the offsets in
// P (NONE: absent, saves as [n, slot] pairs).

struct P {
    cu: u32,
    positions: u32,
    slots: u32,
    restores: u32,
    saves: u32,
    drafts: u32,
    seqs: u32,
    width: u32,
    elems: u32,
    conv_dim: u32,
    taps: u32,
}
var<immediate> p: P;

@group(0) @binding(0) var<storage, read> st: array<u32>;
@group(0) @binding(1) var<storage, read> proj: array<f32>;
@group(0) @binding(2) var<storage, read_write> state: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

const NONE: u32 = 0xffffffffu;

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

fn fresh(r0: u32) -> bool {
    return st[p.positions + r0] == 0u;
}

// y[t, c] = silu(sum_j w[c, j] x[t - K + 1 + j, c]), inputs before the chunk from the window
// (zeros for a fresh request). Grid: (conv_dim / 256 rounded up, T).
@compute @workgroup_size(256)
fn conv(@builtin(global_invocation_id) id: vec3<u32>) {
    let c = id.x;
    let t = id.y;
    if c >= p.conv_dim {
        return;
    }
    let i = request_of(p.cu, p.seqs, t);
    let r0 = st[p.cu + i];
    let restart = fresh(r0);
    let window = st[p.slots + i] * p.elems;
    var acc = 0.0;
    for (var j = 0u; j < p.taps; j++) {
        // Token t - (K - 1) + j, as row m of the window when before the chunk.
        let back = p.taps - 1u - j;
        var x = 0.0;
        if t >= r0 + back {
            x = proj[(t - back) * p.width + c];
        } else if !restart {
            let m = p.taps - 1u - (r0 + back - t);
            x = state[window + m * p.conv_dim + c];
        }
        acc += w[c * p.taps + j] * x;
    }
    y[t * p.conv_dim + c] = silu(acc);
}

// Row m of the window after the chunk's first n tokens: the last K - 1 inputs of
// window ++ chunk[..n].
fn window_row(window: u32, r0: u32, n: u32, m: u32, c: u32, restart: bool) -> f32 {
    if n + m >= p.taps - 1u {
        return proj[(r0 + n + m - (p.taps - 1u)) * p.width + c];
    }
    if restart {
        return 0.0;
    }
    return state[window + (m + n) * p.conv_dim + c];
}

// Slides each request's window over its chunk, after writing the window after the first n
// tokens into a checkpoint (saves) and after each draft token into its slot (drafts). After
// `conv`, which reads the old window. Grid: (conv_dim / 256 rounded up, requests).
@compute @workgroup_size(256)
fn slide(@builtin(global_invocation_id) id: vec3<u32>) {
    let c = id.x;
    let i = id.y;
    if c >= p.conv_dim {
        return;
    }
    let r0 = st[p.cu + i];
    let n = st[p.cu + i + 1u] - r0;
    if n == 0u {
        return;
    }
    let restart = fresh(r0);
    let window = st[p.slots + i] * p.elems;
    let rows = p.taps - 1u;
    if p.saves != NONE && st[p.saves + 2u * i + 1u] != NONE {
        let to = st[p.saves + 2u * i + 1u] * p.elems;
        let after = st[p.saves + 2u * i];
        for (var m = 0u; m < rows; m++) {
            state[to + m * p.conv_dim + c] = window_row(window, r0, after, m, c, restart);
        }
    }
    if p.drafts != NONE && st[p.drafts + 2u * i + 1u] != NONE {
        let first = st[p.drafts + 2u * i];
        for (var after = first; after < n; after++) {
            let to = (st[p.drafts + 2u * i + 1u] + after - first) * p.elems;
            for (var m = 0u; m < rows; m++) {
                state[to + m * p.conv_dim + c] = window_row(window, r0, after, m, c, restart);
            }
        }
    }
    // Ascending m reads rows m + n > m, not yet overwritten.
    for (var m = 0u; m < rows; m++) {
        state[window + m * p.conv_dim + c] = window_row(window, r0, n, m, c, restart);
    }
}

// A prefix-cache hit starts from its checkpoint: slot restores[i]'s state copied into the
// request's own, before the other kernels. Grid: (elems / 256 rounded up, requests).
@compute @workgroup_size(256)
fn restore(@builtin(global_invocation_id) id: vec3<u32>) {
    let i = id.y;
    let src = st[p.restores + i];
    if src == NONE || id.x >= p.elems {
        return;
    }
    state[st[p.slots + i] * p.elems + id.x] = state[src * p.elems + id.x];
}
