// The parameters of the matmul kernels (prepended to gemv, matmul and matmul_coop): y[m, off
// + n] (+)= x[m, :] . w[n, :] for rows row0.. of x and y, w's scale words from `scales` on.

struct P {
    m: u32,
    n: u32,
    k: u32,
    ldy: u32,
    off: u32,
    // 1: added into y (the residual stream).
    add: u32,
    // The first row of x and y (the matrix-vector kernel takes a step's rows 8 at a time).
    row0: u32,
    // The word where a quantized part's block scales start.
    scales: u32,
    // The matrix-vector kernel's expert mode (0: off): pairs of (token, expert) per row of
    // x; w holds every expert's n rows in turn.
    div: u32,
    // The matrix-vector kernel's fused input and epilogue. `norm` 1: x's rows RMS-normalized
    // (weight `gamma`, epsilon `eps`) on the way in. `gated` 1 SiLU, 2 GELU (tanh): w is
    // [gate; up] stacked by rows and y[m, n] = act(gate_n) * up_n, n < p.n / 2.
    norm: u32,
    eps: f32,
    gated: u32,
}
var<immediate> p: P;
