//! Turns a row of logits into a token: penalties, bans, greedy or temperature / top-k /
//! top-p / min-p sampling, and logprobs of the model's raw distribution.

use ferrite_core::output::{SampledToken, TokenLogprob};
use ferrite_core::scheduler::SampleSpec;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

pub struct Sampler {
    /// Draws for requests without a seed; seeded once from `--seed` when given.
    rng: StdRng,
}

/// SplitMix64: spreads (seed, index) into independent RNG seeds.
fn mix(seed: u64, index: u64) -> u64 {
    let mut z = seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Sampler {
    pub fn new(seed: Option<u64>) -> Self {
        Self {
            rng: match seed {
                Some(s) => StdRng::seed_from_u64(s),
                None => StdRng::from_os_rng(),
            },
        }
    }

    /// The key of a device draw: from the request's seed and token index when it has a seed
    /// (reproducible whatever shares the step), else from the engine's RNG.
    pub fn row_key(&mut self, spec: &SampleSpec) -> u64 {
        match spec.params.seed {
            Some(seed) => mix(seed, spec.output_index as u64),
            None => self.rng.random(),
        }
    }

    /// `mask`: the tokens a grammar allows (bit `t % 32` of word `t / 32`), if any.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        spec: &SampleSpec,
        mask: Option<&[u32]>,
    ) -> SampledToken {
        let p = &spec.params;
        // Logprobs describe the model's raw distribution, before bans and penalties.
        let raw = p.logprobs.map(|k| {
            let lse = log_sum_exp(logits);
            (
                top_k_logprobs(logits, k as usize, lse),
                logits.to_vec(),
                lse,
            )
        });
        prepare(logits, spec, mask);
        let token = if p.is_greedy() {
            argmax(logits)
        } else {
            let u = self.uniform(spec, 0);
            draw(logits, p.temperature, p.top_k(), p.top_p, p.min_p, u)
        };
        SampledToken {
            token_id: token,
            logprobs: raw.map(|(top, row, lse)| {
                let (logprob, rank) = logprob_and_rank(&row, token, lse);
                TokenLogprob {
                    token_id: token,
                    logprob,
                    rank,
                    top,
                }
            }),
        }
    }

    /// A uniform draw for `spec`'s token: from its seed and token index when it has a seed;
    /// `stream` separates the draws one token needs (1: a draft's acceptance).
    fn uniform(&mut self, spec: &SampleSpec, stream: u64) -> f32 {
        match spec.params.seed {
            Some(seed) => {
                let key = mix(
                    seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03),
                    spec.output_index as u64,
                );
                StdRng::seed_from_u64(key).random()
            }
            None => self.rng.random(),
        }
    }

    /// Speculative verification of a draft token at this row: kept with probability p(draft)
    /// (the distribution `sample` draws from), else replaced by a draw from p without it. The
    /// token that results follows p exactly, as if drawn directly; greedy keeps the draft only
    /// if it is the argmax. `Err` is the replacement.
    pub fn verify(&mut self, logits: &mut [f32], spec: &SampleSpec, draft: u32) -> Result<(), u32> {
        let p = &spec.params;
        prepare(logits, spec, None);
        if p.is_greedy() {
            let best = argmax(logits);
            return if best == draft { Ok(()) } else { Err(best) };
        }
        let Some(mut kept) = kept(logits, p.temperature, p.top_k(), p.top_p, p.min_p) else {
            let best = argmax(logits);
            return if best == draft { Ok(()) } else { Err(best) };
        };
        let p_draft = kept.iter().find(|c| c.0 == draft).map_or(0.0, |c| c.1);
        if self.uniform(spec, 1) < p_draft {
            return Ok(());
        }
        kept.retain(|c| c.0 != draft);
        let mass: f32 = kept.iter().map(|c| c.1).sum();
        if kept.is_empty() || mass.is_nan() || mass <= 0.0 {
            return Ok(()); // only the draft had mass (rounding): it stays
        }
        Err(pick(&kept, mass, self.uniform(spec, 0)))
    }
}

/// Bans, biases, allowed ids, the grammar mask and penalties, applied to the logits in place.
fn prepare(logits: &mut [f32], spec: &SampleSpec, mask: Option<&[u32]>) {
    let p = &spec.params;
    for &b in &spec.banned_token_ids {
        if let Some(l) = logits.get_mut(b as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
    for &(t, bias) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += bias;
        }
    }
    if let Some(allowed) = &p.allowed_token_ids {
        let mut keep = vec![false; logits.len()];
        for &t in allowed {
            if let Some(k) = keep.get_mut(t as usize) {
                *k = true;
            }
        }
        restrict(logits, |t| keep[t]);
    }
    if let Some(mask) = mask {
        apply_mask(logits, mask);
    }
    if let Some((prompt, output)) = &spec.penalty_context {
        apply_penalties(
            logits,
            prompt,
            output,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        );
    }
}

pub fn log_sum_exp(x: &[f32]) -> f32 {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    m + x.iter().map(|v| (v - m).exp()).sum::<f32>().ln()
}

/// The `k` most likely tokens with their logprobs, most likely first (ties: lower id first).
pub fn top_k_logprobs(logits: &[f32], k: usize, lse: f32) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if k < idx.len() && k > 0 {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx.truncate(k);
    idx.into_iter()
        .map(|i| (i, logits[i as usize] - lse))
        .collect()
}

/// Logprob and 1-based rank of `token` in `logits`.
pub fn logprob_and_rank(logits: &[f32], token: u32, lse: f32) -> (f32, usize) {
    let v = logits[token as usize];
    let rank = 1 + logits
        .iter()
        .enumerate()
        .filter(|&(i, &l)| l > v || (l == v && (i as u32) < token))
        .count();
    (v - lse, rank)
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

fn apply_penalties(
    logits: &mut [f32],
    prompt: &[u32],
    output: &[u32],
    repetition: f32,
    presence: f32,
    frequency: f32,
) {
    if repetition != 1.0 {
        let mut seen = vec![false; logits.len()];
        for &t in prompt.iter().chain(output) {
            let t = t as usize;
            if t < logits.len() && !seen[t] {
                seen[t] = true;
                let l = &mut logits[t];
                *l = if *l > 0.0 {
                    *l / repetition
                } else {
                    *l * repetition
                };
            }
        }
    }
    if presence != 0.0 || frequency != 0.0 {
        let mut counts: HashMap<u32, usize> = HashMap::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, n) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= frequency * n as f32 + presence;
            }
        }
    }
}

/// Samples with `u` in [0, 1) from the tempered distribution restricted by top-k, top-p, min-p.
fn draw(
    logits: &[f32],
    temperature: f32,
    top_k: Option<usize>,
    top_p: f32,
    min_p: f32,
    u: f32,
) -> u32 {
    match kept(logits, temperature, top_k, top_p, min_p) {
        Some(kept) => pick(&kept, kept.iter().map(|c| c.1).sum(), u),
        None => argmax(logits),
    }
}

/// The token at `u * mass` of the cumulative probabilities.
fn pick(kept: &[(u32, f32)], mass: f32, u: f32) -> u32 {
    let mut target = u * mass;
    for &(t, p) in kept {
        target -= p;
        if target < 0.0 {
            return t;
        }
    }
    kept[kept.len() - 1].0
}

/// The tokens the tempered distribution keeps after top-k, min-p and top-p, with their
/// probabilities (before renormalizing over what is kept); `None` when nothing finite is left.
fn kept(
    logits: &[f32],
    temperature: f32,
    top_k: Option<usize>,
    top_p: f32,
    min_p: f32,
) -> Option<Vec<(u32, f32)>> {
    let inv_t = 1.0 / temperature;
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i as u32, l * inv_t))
        .collect();
    if cand.is_empty() {
        return None;
    }
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if let Some(k) = top_k {
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, by_logit);
            cand.truncate(k);
        }
    }
    // Only top-p needs the candidates in order; plain temperature sampling and min-p walk
    // them as they are (sorting 49K logits costs more than the rest of the step's sampling).
    if top_p < 1.0 {
        cand.sort_by(by_logit);
    }
    let m = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1));
    let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - m).exp()).collect();
    let total: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if min_p > 0.0 {
        // The most likely candidate has probability exp(0) / total.
        let floor = min_p / total;
        let mut i = 0;
        cand.retain(|_| {
            i += 1;
            probs[i - 1] >= floor
        });
        probs.retain(|&p| p >= floor);
    }
    // Non-finite probabilities (an overflowing scale) leave nothing to draw from.
    if probs.is_empty() || !probs.iter().all(|p| p.is_finite()) {
        return None;
    }
    let mut keep = probs.len();
    if top_p < 1.0 {
        let mut acc = 0.0;
        for (i, p) in probs.iter().enumerate() {
            acc += p;
            if acc >= top_p {
                keep = i + 1;
                break;
            }
        }
    }
    Some(
        cand[..keep]
            .iter()
            .zip(&probs)
            .map(|(c, &p)| (c.0, p))
            .collect(),
    )
}

/// Sets every logit whose token `keep` refuses to -inf.
fn restrict(logits: &mut [f32], keep: impl Fn(usize) -> bool) {
    for (t, l) in logits.iter_mut().enumerate() {
        if !keep(t) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// -inf for every token whose bit in `mask` is clear, 32 tokens per mask word (a grammar's
/// mask is mostly whole words of zeros).
fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    for (i, chunk) in logits.chunks_mut(32).enumerate() {
        match mask.get(i).copied().unwrap_or(0) {
            u32::MAX => {}
            0 => chunk.fill(f32::NEG_INFINITY),
            w => {
                for (b, l) in chunk.iter_mut().enumerate() {
                    if w >> b & 1 == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::draw;
    use std::collections::BTreeSet;

    /// Probabilities proportional to e^0 .. e^4: about 0.012, 0.032, 0.086, 0.234, 0.636.
    const LOGITS: [f32; 5] = [0.0, 1.0, 2.0, 3.0, 4.0];

    fn drawn(top_k: Option<usize>, top_p: f32, min_p: f32) -> BTreeSet<u32> {
        (0..2000)
            .map(|i| draw(&LOGITS, 1.0, top_k, top_p, min_p, (i as f32 + 0.5) / 2000.0))
            .collect()
    }

    #[test]
    fn draws_follow_the_distribution_and_its_cuts() {
        let z: f64 = LOGITS.iter().map(|&l| (l as f64).exp()).sum();
        let mut counts = [0usize; 5];
        let n = 20_000;
        for i in 0..n {
            counts[draw(&LOGITS, 1.0, None, 1.0, 0.0, (i as f32 + 0.5) / n as f32) as usize] += 1;
        }
        for (t, &c) in counts.iter().enumerate() {
            let p = (LOGITS[t] as f64).exp() / z;
            assert!(
                (c as f64 / n as f64 - p).abs() < 1e-3,
                "token {t}: {c} of {n}, p = {p}"
            );
        }
        assert_eq!(drawn(None, 1.0, 0.0), BTreeSet::from([0, 1, 2, 3, 4]));
        assert_eq!(drawn(Some(2), 1.0, 0.0), BTreeSet::from([3, 4]));
        // 0.636 < 0.8 <= 0.636 + 0.234.
        assert_eq!(drawn(None, 0.8, 0.0), BTreeSet::from([3, 4]));
        // Floor 0.3 * 0.636 = 0.19.
        assert_eq!(drawn(None, 1.0, 0.3), BTreeSet::from([3, 4]));
        assert_eq!(drawn(Some(3), 0.95, 0.1), BTreeSet::from([2, 3, 4]));
    }

    proptest::proptest! {
        /// The draw is total: whatever the temperature (down to 1e-40, where 1/T overflows)
        /// and the cuts, it returns a token of the vocabulary and never panics.
        #[test]
        fn every_draw_returns_a_token(
            logits in proptest::collection::vec(-1e30f32..1e30, 1..64),
            exponent in -40f32..2.0,
            top_k in proptest::option::of(1usize..80),
            top_p in 1e-6f32..=1.0,
            min_p in 0f32..=1.0,
            u in 0f32..1.0,
        ) {
            let t = draw(&logits, 10f32.powf(exponent), top_k, top_p, min_p, u);
            proptest::prop_assert!((t as usize) < logits.len());
        }
    }
}
