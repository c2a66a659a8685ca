// Activation functions (prepended to the element-wise kernels and the matrix-vector kernel).

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

// tanh of a clamped argument: some drivers' tanh overflows to NaN far out.
fn tanh_(v: f32) -> f32 {
    return tanh(clamp(v, -15.0, 15.0));
}

fn gelu_tanh(v: f32) -> f32 {
    let u = 0.7978845608 * (v + 0.044715 * v * v * v);
    return 0.5 * v * (1.0 + tanh_(u));
}

// A gated MLP's activation of its gate: `kind` 0 SiLU, 1 GELU (tanh).
fn gate_activation(kind: u32, v: f32) -> f32 {
    return select(silu(v), gelu_tanh(v), kind == 1u);
}
