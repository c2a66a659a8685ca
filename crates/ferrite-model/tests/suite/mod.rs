//! The backend conformance suite: every op of the `Backend` trait, driven through the trait
//! alone, on a backend under test and on the reference (the CPU backend with f32 weights
//! and f32 K/V, itself checked against f64 references and transformers in `attention.rs`,
//! `oracle.rs` and `families.rs`). Each case feeds the same inputs to both, reads an output
//! back through `Backend::hidden` or `Backend::logits`, and compares: the error is the
//! largest absolute difference over the largest absolute reference value. A backend may
//! refuse an op it does not serve (CUDA: the encoders' ops): the suite lists it as refused.
//! Tokens drawn from logits rows are checked against their distribution (`draws.rs`).
//! `tests/conformance.rs` runs it on the CPU backend's int8 path; `tests/cuda.rs` on CUDA.

#![allow(dead_code)]

mod draws;

use anyhow::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use ferrite_model::backend::cpu::CpuBackend;
use ferrite_model::backend::*;
use ferrite_model::config::RopeScaling;
use ferrite_model::config::RopeStyle;
use ferrite_model::kv_dtype::KvCacheDtype;
use ferrite_model::rope::RopeSpec;
use ferrite_model::settings::WeightFormat;
use ferrite_model::step::PackedStep;

/// Largest error each kind of op may show against the reference.
pub struct Tolerances {
    /// Matmuls with every input mode and epilogue, the LM head, norms.
    pub linear: f32,
    /// Attention with K/V stored as each type (the reference stores f32).
    pub attention: fn(KvCacheDtype) -> f32,
    pub moe: f32,
    pub gated_delta: f32,
    /// Element-wise ops and the encoders' ops.
    pub pointwise: f32,
}

/// A case's outcome.
pub struct Outcome {
    pub case: String,
    /// `None`: the backend refused the op.
    pub error: Option<f32>,
    pub tolerance: f32,
}

/// Runs every case on `make()`'s backends against the reference; prints the table and
/// returns it.
pub fn run<B: Backend>(make: &dyn Fn() -> B, tol: &Tolerances) -> Vec<Outcome> {
    let reference = || CpuBackend::new(WeightFormat::F32, None);
    let mut out = Vec::new();
    let mut check = |case: String, t: f32, got: Result<Vec<f32>>, want: Result<Vec<f32>>| {
        out.push(outcome(case, t, got, want));
    };
    for rows in [3, 40] {
        for (dtype, input, epilogue) in linear_cases() {
            let case = format!("matmul {rows} rows, {dtype:?} weights, {input:?} in, {epilogue:?}");
            let c = Linear {
                rows,
                dtype,
                input,
                epilogue,
            };
            check(
                case,
                tol.linear,
                c.run(&mut make()),
                c.run(&mut reference()),
            );
        }
        for softcap in [None, Some(5.0)] {
            let case = format!("logits {rows} rows, softcap {softcap:?}");
            let c = Logits { rows, softcap };
            check(
                case,
                tol.linear,
                c.run(&mut make()),
                c.run(&mut reference()),
            );
        }
    }
    for kv in [
        KvCacheDtype::Fp32,
        KvCacheDtype::Fp16,
        KvCacheDtype::Bf16,
        KvCacheDtype::Fp8,
        KvCacheDtype::Int8,
    ] {
        for c in attention_cases(kv) {
            let case = format!("attention {c:?}");
            let want = Attention {
                kv: KvCacheDtype::Fp32,
                ..c.clone()
            }
            .run(&mut reference());
            check(case, (tol.attention)(kv), c.run(&mut make()), want);
        }
    }
    for rows in [3, 40] {
        for (norm_topk, shared) in [(true, false), (false, true)] {
            let c = Mixture {
                rows,
                norm_topk,
                shared,
            };
            let case = format!("mixture {rows} rows, norm_topk {norm_topk}, shared {shared}");
            check(case, tol.moe, c.run(&mut make()), c.run(&mut reference()));
        }
    }
    // Every chunking against the reference's whole prompts: the chunked form (prefills) and
    // the recurrent one (decodes) agree.
    for k_dim in [32, 128] {
        let whole = GatedDelta { chunk: 64, k_dim }.run(&mut reference());
        for chunk in [1, 5, 64] {
            let case = format!("gated delta-net, heads of {k_dim}, steps of {chunk} tokens");
            let got = GatedDelta { chunk, k_dim }.run(&mut make());
            check(case, tol.gated_delta, got, clone(&whole));
        }
    }
    check(
        "gated delta-net, checkpoints saved and restored".into(),
        tol.gated_delta,
        GdnCheckpoints.run(&mut make()),
        GdnCheckpoints.run(&mut reference()),
    );
    for op in [
        Pointwise::GateSigmoid,
        Pointwise::RmsNormRows,
        Pointwise::EmbedScaled,
        Pointwise::AddRows,
        Pointwise::AddBias(None),
        Pointwise::AddBias(Some(ferrite_model::backend::Pointwise::Gelu)),
        Pointwise::AddBias(Some(ferrite_model::backend::Pointwise::Tanh)),
        Pointwise::LayerNorm,
    ] {
        let case = format!("{op:?}");
        check(
            case,
            tol.pointwise,
            op.run(&mut make()),
            op.run(&mut reference()),
        );
    }
    out.extend(draws::cases(make));
    print_table(&out);
    out
}

/// A case's outcome: `got` (a refusal, or an output) against the reference's `want`.
fn outcome(case: String, tolerance: f32, got: Result<Vec<f32>>, want: Result<Vec<f32>>) -> Outcome {
    let want = want.unwrap_or_else(|e| panic!("{case}: the reference failed: {e:#}"));
    let error = match got {
        Ok(got) => Some(relative_error(&got, &want, &case)),
        Err(e) => {
            println!("{case}: refused ({e:#})");
            None
        }
    };
    Outcome {
        case,
        error,
        tolerance,
    }
}

fn print_table(out: &[Outcome]) {
    println!("{:<100} {:>10} {:>10}", "case", "error", "tolerance");
    for o in out {
        let e = o.error.map_or("refused".into(), |e| format!("{e:.2e}"));
        println!("{:<100} {e:>10} {:>10.1e}", o.case, o.tolerance);
    }
}

/// The cases whose error exceeds their tolerance.
pub fn failures(out: &[Outcome]) -> Vec<&Outcome> {
    out.iter()
        .filter(|o| o.error.is_some_and(|e| e > o.tolerance || e.is_nan()))
        .collect()
}

fn clone(r: &Result<Vec<f32>>) -> Result<Vec<f32>> {
    match r {
        Ok(v) => Ok(v.clone()),
        Err(e) => Err(anyhow::anyhow!("{e:#}")),
    }
}

fn relative_error(got: &[f32], want: &[f32], case: &str) -> f32 {
    assert_eq!(got.len(), want.len(), "{case}: output sizes differ");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    // An output of zeros would make every backend agree.
    assert!(
        scale > 1e-3,
        "{case}: the reference's output is {scale} at most"
    );
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

/// Values representable in bf16, so that no backend rounds its inputs.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        // Uniform in [-1, 1).
        (self.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| half::bf16::from_f32(self.next() * scale).to_f32())
            .collect()
    }

    fn matrix(&mut self, rows: usize, cols: usize, scale: f32, dtype: GgmlDType) -> QTensor {
        let t = Tensor::from_vec(self.vec(rows * cols, scale), (rows, cols), &Device::Cpu);
        QTensor::quantize(&t.unwrap(), dtype).unwrap()
    }
}

const BLOCK: usize = 16;
/// Blocks in each request's table: room for 512 tokens.
const TABLE: usize = 32;

/// A step of requests given as (tokens already cached, new tokens), each in blocks of its
/// own; every row observed. Token ids are the rows' indices, for an embedding table whose
/// rows are the inputs.
fn step(requests: &[(usize, usize)]) -> PackedStep {
    let mut s = PackedStep::default();
    let per = TABLE;
    for (r, &(start, n)) in requests.iter().enumerate() {
        let table: Vec<u32> = (0..per).map(|b| (r * per + b) as u32).collect();
        let ids: Vec<u32> = (0..n).map(|i| (s.input_ids.len() + i) as u32).collect();
        s.push(&ids, start, &[table], BLOCK);
        s.state.slots.push(r as u32);
    }
    s.logits_indices = (0..s.input_ids.len() as u32).collect();
    s.finish();
    s
}

/// Runs `f` in one step of `b` and reads back what it left for `Backend::host_logits`.
fn observe<B: Backend>(
    b: &mut B,
    s: &PackedStep,
    mut f: impl FnMut(&mut B, &Step<B>) -> Result<()> + Send,
) -> Result<Vec<f32>> {
    b.step(s, None, &mut f)?;
    Ok(b.host_logits()?.to_vec())
}

/// The step's rows of `table` as an activation (the residual stream's form).
fn embed<B: Backend>(b: &mut B, s: &Step<B>, table: &B::Embedding) -> Result<B::Act> {
    let mut x = B::Act::default();
    b.embed(s, table, None, &mut x)?;
    Ok(x)
}

/// Turns an embedding's rows into a matmul's output (the form attention, the delta rule
/// and the gate read; a residual-stream row may be stored otherwise, f32 beside bf16 on
/// CUDA): each row RMS-normed, then through the identity.
struct AsOutput<B: Backend> {
    ones: B::Vector,
    id: B::Linear,
}

impl<B: Backend> AsOutput<B> {
    fn new(b: &B, k: usize) -> Result<Self> {
        let t = Tensor::eye(k, candle_core::DType::F32, &Device::Cpu)?;
        Ok(Self {
            ones: b.vector(vec![1.0; k])?,
            id: b.linear(
                vec![QTensor::quantize(&t, GgmlDType::F32)?],
                Stack::Concat,
                Rounding::Fine,
            )?,
        })
    }

    /// The step's rows of `table`, in a matmul's output form.
    fn rows(&self, b: &mut B, s: &Step<B>, table: &B::Embedding) -> Result<B::Act> {
        let x = embed(b, s, table)?;
        let mut out = B::Act::default();
        let x = LinearIn::RmsNorm {
            x: &x,
            norm: &self.ones,
            eps: 1e-6,
        };
        b.matmul(x, &self.id, Epilogue::Store(&mut out))?;
        Ok(out)
    }
}

#[derive(Clone, Copy, Debug)]
enum Input {
    RmsNorm,
    /// The output of a matmul before it (the activations' own form).
    Plain,
}

#[derive(Clone, Copy, Debug)]
enum Out {
    Store,
    StoreResidual,
    AddInto,
    AddNormedInto,
    Gated(Activation),
}

fn linear_cases() -> Vec<(GgmlDType, Input, Out)> {
    let mut v = Vec::new();
    // 4-bit blocks and K-quants (GGUF types a GPU keeps quantized) with the plain epilogues.
    for dtype in [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        for input in [Input::RmsNorm, Input::Plain] {
            for out in [Out::Store, Out::AddInto] {
                v.push((dtype, input, out));
            }
        }
    }
    for dtype in [GgmlDType::F32, GgmlDType::Q8_0] {
        for input in [Input::RmsNorm, Input::Plain] {
            for out in [
                Out::Store,
                Out::StoreResidual,
                Out::AddInto,
                Out::AddNormedInto,
                Out::Gated(Activation::Silu),
                Out::Gated(Activation::GeluTanh),
            ] {
                v.push((dtype, input, out));
            }
        }
    }
    v
}

struct Linear {
    rows: usize,
    dtype: GgmlDType,
    input: Input,
    epilogue: Out,
}

impl Linear {
    fn run<B: Backend>(&self, b: &mut B) -> Result<Vec<f32>> {
        // A K-quant's super-block is 256 values.
        let (k, n) = (self.dtype.block_size().max(128), 96);
        let mut rng = Rng::new(self.rows as u64);
        let table = b.embedding(rng.matrix(self.rows, k, 1.0, GgmlDType::F32))?;
        let norm = b.vector(rng.vec(k, 1.0).iter().map(|v| 1.0 + v / 2.0).collect())?;
        let pre = b.linear(
            vec![rng.matrix(k, k, 0.1, self.dtype)],
            Stack::Concat,
            Rounding::Coarse,
        )?;
        let w = match self.epilogue {
            Out::Gated(_) => {
                let parts = vec![
                    rng.matrix(n, k, 0.1, self.dtype),
                    rng.matrix(n, k, 0.1, self.dtype),
                ];
                b.linear(parts, Stack::GateUp, Rounding::Coarse)?
            }
            _ => b.linear(
                vec![rng.matrix(n, k, 0.1, self.dtype)],
                Stack::Concat,
                Rounding::Fine,
            )?,
        };
        let residual = b.embedding(rng.matrix(self.rows, n, 1.0, GgmlDType::F32))?;
        let out_norm = b.vector(rng.vec(n, 1.0))?;
        let s = step(&[(0, self.rows)]);
        observe(b, &s, |b, st| {
            let x = embed(b, st, &table)?;
            let mut a = B::Act::default();
            let input = match self.input {
                Input::RmsNorm => LinearIn::RmsNorm {
                    x: &x,
                    norm: &norm,
                    eps: 1e-6,
                },
                Input::Plain => {
                    let first = LinearIn::RmsNorm {
                        x: &x,
                        norm: &norm,
                        eps: 1e-6,
                    };
                    b.matmul(first, &pre, Epilogue::Store(&mut a))?;
                    LinearIn::Plain(&a)
                }
            };
            let mut y = B::Act::default();
            let mut r = embed(b, st, &residual)?;
            let seen = match self.epilogue {
                Out::Store => {
                    b.matmul(input, &w, Epilogue::Store(&mut y))?;
                    &y
                }
                Out::StoreResidual => {
                    b.matmul(input, &w, Epilogue::StoreResidual(&mut y))?;
                    &y
                }
                Out::AddInto => {
                    b.matmul(input, &w, Epilogue::AddInto(&mut r))?;
                    &r
                }
                Out::AddNormedInto => {
                    let e = Epilogue::AddNormedInto {
                        residual: &mut r,
                        norm: &out_norm,
                        eps: 1e-6,
                    };
                    b.matmul(input, &w, e)?;
                    &r
                }
                Out::Gated(act) => {
                    b.matmul(input, &w, Epilogue::Gated(&mut y, act))?;
                    &y
                }
            };
            b.hidden(st, seen, None)
        })
    }
}

/// The LM head on some rows: the final norm of those rows, the head, the soft-cap.
struct Logits {
    rows: usize,
    softcap: Option<f32>,
}

impl Logits {
    fn run<B: Backend>(&self, b: &mut B) -> Result<Vec<f32>> {
        let (k, vocab) = (128, 300);
        let mut rng = Rng::new(7 + self.rows as u64);
        let table = b.embedding(rng.matrix(self.rows, k, 1.0, GgmlDType::F32))?;
        let norm = b.vector(rng.vec(k, 1.0))?;
        let head = b.linear(
            vec![rng.matrix(vocab, k, 0.5, GgmlDType::Q8_0)],
            Stack::Concat,
            Rounding::Fine,
        )?;
        // The last row and one in the middle.
        let mut s = step(&[(0, self.rows)]);
        s.logits_indices = vec![self.rows as u32 / 2, self.rows as u32 - 1];
        observe(b, &s, |b, st| {
            let x = embed(b, st, &table)?;
            b.logits(st, &x, &norm, 1e-6, &head, self.softcap)
        })
    }
}

#[derive(Clone, Debug)]
struct Attention {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    softcap: Option<f32>,
    /// Q/K norms and a QKV bias.
    normed: bool,
    rope: Option<RopeStyle>,
    kv: KvCacheDtype,
    length: Length,
}

#[derive(Clone, Copy, Debug)]
enum Length {
    /// Prompts of tens of tokens.
    Short,
    /// Prompts of hundreds of tokens (keys over many tiles, rotary far from 0).
    Long,
    /// Those prompts, then decodes alone (a GPU may split their keys over workgroups).
    Decodes,
}

fn attention_cases(kv: KvCacheDtype) -> Vec<Attention> {
    let plain = Attention {
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        window: None,
        softcap: None,
        normed: false,
        rope: Some(RopeStyle::Neox),
        kv,
        length: Length::Short,
    };
    vec![
        plain.clone(),
        Attention {
            heads: 8,
            kv_heads: 1,
            head_dim: 128,
            rope: Some(RopeStyle::Interleaved),
            normed: true,
            ..plain.clone()
        },
        Attention {
            window: Some(12),
            softcap: Some(20.0),
            ..plain.clone()
        },
        Attention {
            heads: 2,
            kv_heads: 2,
            head_dim: 256,
            ..plain.clone()
        },
        Attention {
            heads: 8,
            kv_heads: 2,
            head_dim: 128,
            window: Some(200),
            length: Length::Long,
            ..plain.clone()
        },
        Attention {
            heads: 8,
            kv_heads: 2,
            head_dim: 128,
            length: Length::Decodes,
            ..plain
        },
    ]
}

impl Attention {
    /// Two steps on the same pages: ragged prompts, then decodes beside a prompt's next
    /// chunk (a long one, or none, as `length` says); the second step's output is read.
    fn run<B: Backend>(&self, b: &mut B) -> Result<Vec<f32>> {
        let (h, hkv, d) = (self.heads, self.kv_heads, self.head_dim);
        let width = (h + 2 * hkv) * d;
        let (first, second) = match self.length {
            Length::Short => ([(0, 37), (0, 5), (0, 20)], [(37, 1), (5, 9), (20, 1)]),
            Length::Long => ([(0, 300), (0, 5), (0, 90)], [(300, 1), (5, 190), (90, 1)]),
            Length::Decodes => ([(0, 300), (0, 5), (0, 90)], [(300, 1), (5, 1), (90, 1)]),
        };
        let mut rng = Rng::new(d as u64 + h as u64);
        let rows = |steps: &[(usize, usize)]| steps.iter().map(|r| r.1).sum::<usize>();
        let tables = [first.as_slice(), second.as_slice()]
            .map(|st| b.embedding(rng.matrix(rows(st), width, 1.0, GgmlDType::F32)));
        let mut cache = b.layer_cache(3 * TABLE, BLOCK, hkv, d, self.kv)?;
        let as_output = AsOutput::new(b, width)?;
        let rope = match self.rope {
            Some(style) => Some(b.rope(
                &RopeSpec {
                    dim: d,
                    theta: 10000.0,
                    style,
                    scaling: RopeScaling::None,
                },
                512,
            )?),
            None => None,
        };
        let norm =
            |b: &B, rng: &mut Rng| b.vector(rng.vec(d, 0.5).iter().map(|v| 1.0 + v).collect());
        let (q_norm, k_norm, bias) = match self.normed {
            true => (
                Some(norm(b, &mut rng)?),
                Some(norm(b, &mut rng)?),
                Some(b.vector(rng.vec(width, 0.5))?),
            ),
            false => (None, None, None),
        };
        let spec = AttentionSpec {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: d,
            scale: 1.0 / (d as f32).sqrt(),
            sliding_window: self.window,
            softcap: self.softcap,
            causal: true,
            kv_group: 0,
            kv_slot: 0,
        };
        let mut out = Vec::new();
        for (steps, table) in [first.as_slice(), second.as_slice()].iter().zip(&tables) {
            let table = table.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
            let prep = QkvPrep {
                bias: bias.as_ref(),
                q_norm: q_norm.as_ref(),
                k_norm: k_norm.as_ref(),
                eps: 1e-6,
                rope: rope.as_ref(),
            };
            out = observe(b, &step(steps), |b, st| {
                let qkv = as_output.rows(b, st, table)?;
                let (mut q, mut o) = (B::Act::default(), B::Act::default());
                b.prepare_qkv(st, &qkv, &prep, &spec, &mut cache, &mut q)?;
                b.attention(st, &q, &cache, &spec, None, &mut o)?;
                b.hidden(st, &o, None)
            })?;
        }
        Ok(out)
    }
}

struct Mixture {
    rows: usize,
    norm_topk: bool,
    shared: bool,
}

impl Mixture {
    fn run<B: Backend>(&self, b: &mut B) -> Result<Vec<f32>> {
        let (hidden, inter, experts) = (128, 64, 8);
        let mut rng = Rng::new(11 + self.rows as u64);
        let expert = |rng: &mut Rng| ExpertMatrices {
            gate: rng.matrix(inter, hidden, 0.1, GgmlDType::Q8_0),
            up: rng.matrix(inter, hidden, 0.1, GgmlDType::Q8_0),
            down: rng.matrix(hidden, inter, 0.1, GgmlDType::Q8_0),
        };
        let m = MoeMatrices {
            router: rng.matrix(experts, hidden, 0.5, GgmlDType::F32),
            experts: (0..experts).map(|_| expert(&mut rng)).collect(),
            shared: self.shared.then(|| expert(&mut rng)),
            shared_gate: self
                .shared
                .then(|| rng.matrix(1, hidden, 0.5, GgmlDType::F32)),
        };
        let spec = MoeSpec {
            num_experts: experts,
            top_k: 2,
            norm_topk: self.norm_topk,
            act: Activation::Silu,
        };
        let moe = b.moe(m, spec)?;
        let table = b.embedding(rng.matrix(self.rows, hidden, 1.0, GgmlDType::F32))?;
        let norm = b.vector(rng.vec(hidden, 0.5).iter().map(|v| 1.0 + v).collect())?;
        observe(b, &step(&[(0, self.rows)]), |b, st| {
            let mut x = embed(b, st, &table)?;
            b.mixture(&mut x, &norm, 1e-6, &moe)?;
            b.hidden(st, &x, None)
        })
    }
}

/// A delta-net layer's spec, inputs and small weights on a backend: heads of `k_dim` (32,
/// or the real models' 128), a projection a multiple of 32 wide (as the int8 path's
/// matmuls take), the inputs of requests of `lens` tokens.
struct GdnLayer<B: Backend> {
    spec: GdnSpec,
    inputs: Vec<Vec<f32>>,
    conv: B::Vector,
    a_log: B::Vector,
    dt_bias: B::Vector,
    norm: B::Vector,
    as_output: AsOutput<B>,
}

impl<B: Backend> GdnLayer<B> {
    fn new(b: &B, k_dim: usize, lens: &[usize]) -> Result<Self> {
        let spec = GdnSpec {
            num_k_heads: 128 / k_dim,
            num_v_heads: 16,
            k_dim,
            v_dim: k_dim,
            conv_kernel: 4,
            eps: 1e-6,
        };
        let mut rng = Rng::new(5);
        let inputs = lens
            .iter()
            .map(|&n| rng.vec(n * spec.proj_dim(), 1.0))
            .collect();
        Ok(Self {
            conv: b.vector(rng.vec(spec.conv_dim() * spec.conv_kernel, 0.5))?,
            a_log: b.vector(rng.vec(spec.num_v_heads, 1.0))?,
            dt_bias: b.vector(rng.vec(spec.num_v_heads, 1.0))?,
            norm: b.vector(rng.vec(spec.v_dim, 0.5).iter().map(|v| 1.0 + v).collect())?,
            as_output: AsOutput::new(b, spec.proj_dim())?,
            inputs,
            spec,
        })
    }

    /// One step: each of `chunks` (request, first token, tokens) as a row range of that
    /// request's inputs; the layer's output rows in order.
    fn run(
        &self,
        b: &mut B,
        s: &mut PackedStep,
        chunks: &[(usize, usize, usize)],
        state: &mut B::StateCache,
    ) -> Result<Vec<f32>> {
        let w = self.spec.proj_dim();
        let rows: Vec<f32> = chunks
            .iter()
            .flat_map(|&(r, a, n)| self.inputs[r][a * w..(a + n) * w].iter().copied())
            .collect();
        let n = rows.len() / w;
        let t = Tensor::from_vec(rows, (n, w), &Device::Cpu)?;
        let table = b.embedding(QTensor::quantize(&t, GgmlDType::F32)?)?;
        let p = GdnParams {
            conv: &self.conv,
            a_log: &self.a_log,
            dt_bias: &self.dt_bias,
            norm: &self.norm,
        };
        observe(b, s, |b, st| {
            let proj = self.as_output.rows(b, st, &table)?;
            let mut out = B::Act::default();
            b.gated_delta(st, &proj, &p, &self.spec, state, &mut out)?;
            b.hidden(st, &out, None)
        })
    }
}

/// Two requests through the delta rule in steps of `chunk` tokens each (the first 40
/// tokens long, the second 9): the state carries over between steps.
struct GatedDelta {
    chunk: usize,
    k_dim: usize,
}

impl GatedDelta {
    fn run<B: Backend>(&self, b: &mut B) -> Result<Vec<f32>> {
        let lens = [40usize, 9];
        let layer = GdnLayer::new(b, self.k_dim, &lens)?;
        let mut state = b.state_cache(2, &layer.spec)?;
        // Each request's outputs in order, whatever steps they came in.
        let mut seen = vec![Vec::new(); 2];
        let mut at = [0usize; 2];
        while at.iter().zip(&lens).any(|(a, n)| a < n) {
            // The requests with tokens left, by slot.
            let live: Vec<usize> = (0..2).filter(|&r| at[r] < lens[r]).collect();
            let chunks: Vec<(usize, usize, usize)> = live
                .iter()
                .map(|&r| (r, at[r], self.chunk.min(lens[r] - at[r])))
                .collect();
            let spans: Vec<(usize, usize)> = chunks.iter().map(|c| (c.1, c.2)).collect();
            let mut s = step(&spans);
            s.state.slots = live.iter().map(|&r| r as u32).collect();
            let out = layer.run(b, &mut s, &chunks, &mut state)?;
            let width = out.len() / spans.iter().map(|c| c.1).sum::<usize>();
            let mut rows = out.chunks(width);
            for (&r, c) in live.iter().zip(&spans) {
                at[r] += c.1;
                seen[r].extend(rows.by_ref().take(c.1).flatten());
            }
        }
        Ok(seen.concat())
    }
}

/// The state's checkpoints: a 16-token chunk writes its state after 10 tokens to slot 2 (a
/// prefix-cache save) and after 12, 13, 14 and 15 tokens to slots 3 to 6 (a verify step's
/// drafts); in the next step two requests start from slots 2 and 5 (restores) and go on
/// with the same tokens, beside the first request's next chunk.
struct GdnCheckpoints;

impl GdnCheckpoints {
    fn run<B: Backend>(&self, b: &mut B) -> Result<Vec<f32>> {
        use ferrite_model::step::NO_SLOT;
        let layer = GdnLayer::new(b, 32, &[24])?;
        let mut state = b.state_cache(8, &layer.spec)?;
        let mut first = step(&[(0, 16)]);
        first.state.saves = vec![[10, 2]];
        first.state.drafts = vec![[12, 3]];
        let mut out = layer.run(b, &mut first, &[(0, 0, 16)], &mut state)?;
        let chunks = [(0, 16, 8), (0, 10, 8), (0, 14, 6)];
        let mut next = step(&[(16, 8), (10, 8), (14, 6)]);
        next.state.slots = vec![0, 1, 7];
        next.state.restores = vec![NO_SLOT, 2, 5];
        out.extend(layer.run(b, &mut next, &chunks, &mut state)?);
        Ok(out)
    }
}

/// The small ops: element-wise, norms, and the encoders' ops.
#[derive(Clone, Copy, Debug)]
enum Pointwise {
    GateSigmoid,
    RmsNormRows,
    EmbedScaled,
    AddRows,
    AddBias(Option<ferrite_model::backend::Pointwise>),
    LayerNorm,
}

impl Pointwise {
    fn run<B: Backend>(&self, b: &mut B) -> Result<Vec<f32>> {
        let (rows, k) = (9, 96);
        let mut rng = Rng::new(3);
        let table = b.embedding(rng.matrix(rows, k, 2.0, GgmlDType::F32))?;
        let other = b.embedding(rng.matrix(rows, k, 2.0, GgmlDType::F32))?;
        let w = b.vector(rng.vec(k, 1.0))?;
        let bias = b.vector(rng.vec(k, 1.0))?;
        let as_output = AsOutput::new(b, k)?;
        let op = *self;
        observe(b, &step(&[(0, rows)]), |b, st| {
            let mut x = embed(b, st, &table)?;
            match op {
                Pointwise::GateSigmoid => {
                    let mut a = as_output.rows(b, st, &table)?;
                    let g = as_output.rows(b, st, &other)?;
                    b.gate_sigmoid(&mut a, &g)?;
                    return b.hidden(st, &a, None);
                }
                Pointwise::RmsNormRows => {
                    let mut out = B::Act::default();
                    b.rms_norm_rows(&x, &[], &w, 1e-6, &mut out)?;
                    return b.hidden(st, &out, None);
                }
                Pointwise::EmbedScaled => b.embed(st, &table, Some(0.37), &mut x)?,
                Pointwise::AddRows => b.add_rows(&other, &st.host.input_ids, &mut x)?,
                Pointwise::AddBias(then) => b.add_bias(&mut x, &bias, then)?,
                Pointwise::LayerNorm => b.layer_norm(&mut x, &w, &bias, 1e-5)?,
            }
            b.hidden(st, &x, None)
        })
    }
}

/// The decoder families' tiny checkpoints (`tests/oracle/tiny`, written by transformers).
pub const FAMILIES: [&str; 12] = [
    "llama31",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
];

/// How far a family's logits may stray: `error` (over the reference's largest logit) at
/// every row but the `skip` worst (where a mixture may route a near-tied expert otherwise).
pub struct FamilyBound {
    pub error: f32,
    pub skip: usize,
}

/// Every family's tiny checkpoint through a whole prompt step (the oracle's tokens) on
/// `make()`'s backend with its own K/V type and on the reference (f32 K/V), every row's
/// logits compared.
pub fn families<B: Backend + 'static>(
    make: &dyn Fn() -> B,
    bound: &dyn Fn(&str) -> FamilyBound,
) -> Vec<Outcome> {
    use crate::common::{repo_root, tiny_oracle};
    let mut out = Vec::new();
    for family in FAMILIES {
        let (tokens, _) = tiny_oracle(family, "logits");
        let dir = repo_root().join(format!("tests/oracle/tiny/{family}"));
        let reference = CpuBackend::new(WeightFormat::F32, None);
        let want = prompt_logits(reference, &dir, &tokens, KvCacheDtype::Fp32);
        let got = prompt_logits(make(), &dir, &tokens, KvCacheDtype::Auto);
        let FamilyBound { error, skip } = bound(family);
        let case = format!(
            "{family}: logits of {} prompt tokens, {skip} worst left out",
            tokens.len()
        );
        // The rows' errors without the `skip` worst rows: those rows set to the reference.
        let got = got.map(|mut got| {
            if let Ok(want) = &want {
                let width = want.len() / tokens.len();
                let mut rows: Vec<(f32, usize)> = (0..tokens.len())
                    .map(|r| {
                        let row = r * width..(r + 1) * width;
                        let diff = got[row.clone()]
                            .iter()
                            .zip(&want[row])
                            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                        (diff, r)
                    })
                    .collect();
                rows.sort_by(|a, b| b.0.total_cmp(&a.0));
                for &(_, r) in &rows[..skip.min(rows.len())] {
                    let row = r * width..(r + 1) * width;
                    got[row.clone()].copy_from_slice(&want[row]);
                }
            }
            got
        });
        out.push(outcome(case, error, got, want));
    }
    print_table(&out);
    out
}

/// Every row's logits of one prompt step of `tokens` on the checkpoint in `dir`, K/V stored
/// as `kv`.
fn prompt_logits<B: Backend + 'static>(
    backend: B,
    dir: &std::path::Path,
    tokens: &[u32],
    kv: KvCacheDtype,
) -> Result<Vec<f32>> {
    use ferrite_model::checkpoint::open_weights;
    use ferrite_model::settings::LoadFormat;
    let (src, mut weights) = open_weights(dir, LoadFormat::Auto)?;
    let mut m = ferrite_model::models::load(backend, &src, &mut weights, 256, &mut |_, _| {})?;
    m.set_kv_dtype(kv);
    Ok(crate::common::try_all_logits(&mut m, tokens)?.concat())
}
