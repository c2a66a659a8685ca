//! Tokens drawn from logits rows: on the device where the backend draws there
//! (`Backend::draws_on_device`), else by the engine's host sampler from the step's logits —
//! the path the runner takes on that backend. Checked against the distribution itself:
//! softmax(logits / T) cut as the CPU sampler cuts it (top-k, then top-p, then min-p), by
//! frequency over many rows with their own keys; a cut token is never drawn, a key draws the
//! same token twice, greedy rows take the first of tied maxima, and grammar masks hold.

use super::Outcome;
use anyhow::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use ferrite_core::sampling::SamplingParams;
use ferrite_core::scheduler::SampleSpec;
use ferrite_model::backend::*;
use ferrite_model::sampler::Sampler;
use ferrite_model::step::{DeviceDraws, Masks, PackedStep, RowDraw};
use std::sync::Arc;

/// The logits every sampled row sees; the padding tokens after them are cut too.
const ROW: [f32; 8] = [2.0, 1.0, 0.5, 0.0, -1.0, -1e4, 1.5, -3.0];
const VOCAB: usize = 128;
/// The residual width: rows are one-hot, so RMS-normed they are `sqrt(WIDTH)` = 8 exactly.
const WIDTH: usize = 64;
/// Rows per sampling setting: the binomial standard deviation is at most 0.004.
const ROWS: usize = 16384;
const FREQUENCY_TOLERANCE: f32 = 0.02;

/// Every case on `make()`'s backend (a refusal is listed, as for the ops).
pub fn cases<B: Backend>(make: &dyn Fn() -> B) -> Vec<Outcome> {
    let mut out = Vec::new();
    // (temperature, top_k, top_p, min_p)
    for (t, top_k, top_p, min_p) in [
        (0.7f32, 0u32, 1.0f32, 0.0f32),
        (1.3, 0, 1.0, 0.2),
        (1.0, 3, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (1.5, 5, 0.9, 0.1),
    ] {
        let case = format!("draws T={t} top_k={top_k} top_p={top_p} min_p={min_p}");
        let draws: Vec<RowDraw> = (0..ROWS as u64)
            .map(|i| RowDraw::Sample {
                temperature: t,
                top_k,
                top_p,
                min_p,
                key: i.wrapping_mul(0x2545_F491_4F6C_DD1D) + 17,
            })
            .collect();
        let want = cut_distribution(t, top_k, top_p, min_p);
        let error = (|| {
            let mut b = make();
            let tokens = draw(&mut b, &[padded(&ROW)], &vec![0; ROWS], &draws, None)?;
            let again = draw(&mut b, &[padded(&ROW)], &vec![0; ROWS], &draws, None)?;
            Ok(frequency_error(&tokens, &again, &want))
        })();
        out.push(outcome(case, FREQUENCY_TOLERANCE, error));
    }
    let error = (|| {
        let ties = padded(&[1.0, 3.0, 3.0, 0.0]);
        let tokens = draw(&mut make(), &[ties], &[0], &[RowDraw::Greedy], None)?;
        Ok(if tokens == [1] { 0.0 } else { 1.0 })
    })();
    out.push(outcome("draws greedy, tied maxima".into(), 0.0, error));
    out.push(outcome(
        "draws under grammar masks".into(),
        0.0,
        masked(make),
    ));
    out
}

fn outcome(case: String, tolerance: f32, error: Result<f32>) -> Outcome {
    let error = error.map_err(|e| println!("{case}: refused ({e:#})")).ok();
    Outcome {
        case,
        error,
        tolerance,
    }
}

/// A masked greedy row draws the best token its mask allows, an unmasked one beside it is
/// untouched, masked sampled rows draw only allowed tokens. 1 when any of that fails.
fn masked<B: Backend>(make: &dyn Fn() -> B) -> Result<f32> {
    let sample = |key| RowDraw::Sample {
        temperature: 5.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        key,
    };
    let draws = [RowDraw::Greedy, RowDraw::Greedy, sample(3), sample(4)];
    let words = VOCAB.div_ceil(32);
    // Tokens 1 and 3 only; row 1's mask is never read.
    let mut flat = vec![0u32; 4 * words];
    for (r, w) in flat.chunks_mut(words).enumerate() {
        w[0] = if r == 1 { 0 } else { 0b1010 };
    }
    let rows = [true, false, true, true];
    let t = draw(
        &mut make(),
        &[padded(&ROW)],
        &[0; 4],
        &draws,
        Some((&rows, &flat)),
    )?;
    println!("masked draws: {t:?}");
    let ok = t[..2] == [1, 0] && t[2..].iter().all(|x| *x == 1 || *x == 3);
    Ok(if ok { 0.0 } else { 1.0 })
}

/// `row` followed by cut tokens up to the vocabulary.
fn padded(row: &[f32]) -> Vec<f32> {
    let mut v = row.to_vec();
    v.resize(VOCAB, -1e4);
    v
}

/// softmax(ROW / t) cut as the CPU sampler cuts it.
fn cut_distribution(t: f32, top_k: u32, top_p: f32, min_p: f32) -> Vec<f64> {
    let row = padded(&ROW);
    let mut order: Vec<usize> = (0..VOCAB).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    if top_k > 0 {
        order.truncate(top_k as usize);
    }
    let m = row[order[0]];
    let w: Vec<f64> = order
        .iter()
        .map(|&i| ((row[i] - m) / t).exp() as f64)
        .collect();
    let z: f64 = w.iter().sum();
    let mut keep = order.len();
    let mut acc = 0.0;
    for (j, w) in w.iter().enumerate() {
        acc += w / z;
        if acc >= top_p as f64 {
            keep = keep.min(j + 1);
            break;
        }
    }
    let mut want = vec![0f64; VOCAB];
    for (j, &i) in order.iter().enumerate().take(keep) {
        if w[j] >= min_p as f64 && w[j] > 1e-30 {
            want[i] = w[j];
        }
    }
    let total: f64 = want.iter().sum();
    want.iter().map(|w| w / total).collect()
}

/// The largest difference between a token's frequency and its probability; 1 when a cut
/// token was drawn or the same keys drew differently.
fn frequency_error(tokens: &[u32], again: &[u32], want: &[f64]) -> f32 {
    if tokens != again {
        println!("the same keys drew different tokens");
        return 1.0;
    }
    let mut hist = vec![0usize; VOCAB];
    tokens.iter().for_each(|&t| hist[t as usize] += 1);
    let mut worst = 0f32;
    for (i, (&n, &p)) in hist.iter().zip(want).enumerate() {
        if p == 0.0 && n > 0 {
            println!("token {i} is cut, drawn {n} times");
            return 1.0;
        }
        worst = worst.max((n as f64 / tokens.len() as f64 - p).abs() as f32);
    }
    worst
}

/// One step whose row `r` has the logits `patterns[row_pattern[r]]`, each row drawn as
/// `draws[r]` says, under `masks` (which rows, and their words).
fn draw<B: Backend>(
    b: &mut B,
    patterns: &[Vec<f32>],
    row_pattern: &[usize],
    draws: &[RowDraw],
    masks: Option<(&[bool], &[u32])>,
) -> Result<Vec<u32>> {
    let rows = row_pattern.len();
    // Row r is one-hot at its pattern: RMS-normed it is 8 there, so the head's column j holds
    // pattern j over 8 (exact in every float type: the patterns are small dyadic numbers).
    let mut table = vec![0f32; rows * WIDTH];
    row_pattern
        .iter()
        .enumerate()
        .for_each(|(r, &j)| table[r * WIDTH + j] = 1.0);
    let mut head = vec![0f32; VOCAB * WIDTH];
    for (j, p) in patterns.iter().enumerate() {
        p.iter()
            .enumerate()
            .for_each(|(t, v)| head[t * WIDTH + j] = v / 8.0);
    }
    let matrix = |v: Vec<f32>, r: usize| -> Result<QTensor> {
        let t = Tensor::from_vec(v, (r, WIDTH), &Device::Cpu)?;
        Ok(QTensor::quantize(&t, GgmlDType::F32)?)
    };
    let table = b.embedding(matrix(table, rows)?)?;
    let head = b.linear(vec![matrix(head, VOCAB)?], Stack::Concat, Rounding::Fine)?;
    let norm = b.vector(vec![1.0; WIDTH])?;
    let step = rows_step(rows);
    let mut forward = |b: &mut B, st: &Step<B>| {
        let x = super::embed(b, st, &table)?;
        b.logits(st, &x, &norm, 0.0, &head, None)
    };
    if b.draws_on_device() {
        let fill = |out: &mut [u32], words: usize| {
            if let Some((_, flat)) = masks {
                out.copy_from_slice(&flat[..rows * words]);
            }
        };
        let d = DeviceDraws {
            rows: draws,
            masks: masks.map(|(rows, _)| Masks { rows, fill: &fill }),
        };
        b.step(&step, Some(d), &mut forward)?;
        return b.drawn_tokens();
    }
    b.step(&step, None, &mut forward)?;
    let logits = b.host_logits()?;
    let mut sampler = Sampler::new(Some(0));
    let words = VOCAB.div_ceil(32);
    let tokens = logits
        .chunks_mut(VOCAB)
        .zip(draws)
        .enumerate()
        .map(|(r, (row, d))| {
            let mask = masks
                .filter(|(on, _)| on[r])
                .map(|(_, flat)| &flat[r * words..][..words]);
            sampler.sample(row, &host_spec(d), mask).token_id
        })
        .collect();
    Ok(tokens)
}

/// What the host sampler is given for a row the device would draw as `d`: the key is the
/// seed (the host's draws differ from the device's, their distribution does not).
fn host_spec(d: &RowDraw) -> SampleSpec {
    let params = match *d {
        RowDraw::Greedy => SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        RowDraw::Sample {
            temperature,
            top_k,
            top_p,
            min_p,
            key,
        } => SamplingParams {
            temperature,
            top_k: if top_k == 0 { -1 } else { top_k as i64 },
            top_p,
            min_p,
            seed: Some(key),
            ..Default::default()
        },
    };
    SampleSpec {
        params: Arc::new(params),
        output_index: 0,
        banned_token_ids: Vec::new(),
        penalty_context: None,
        constraint: None,
    }
}

/// `rows` prompt tokens as requests of a block table's worth each, every row a logits row.
fn rows_step(rows: usize) -> PackedStep {
    let per = super::BLOCK * 8;
    let requests: Vec<(usize, usize)> = (0..rows.div_ceil(per))
        .map(|i| (0, per.min(rows - i * per)))
        .collect();
    super::step(&requests)
}
