//! What a step costs in time: `fixed + per_token * tokens + per_pair * pairs + per_row * rows`,
//! where `pairs` counts the (query, key) pairs attention computes and `rows` the requests
//! (each with its logits row and its sampling). Fitted at start-up from timed steps
//! and refitted online from every step the engine runs (recursive least squares that
//! forgets old steps), so the scheduler can size a step's prefill share to keep running
//! decodes within a time target (`--max-step-ms`).

/// (query, key) pairs of a causal chunk of `n` tokens after `start` cached ones.
pub fn chunk_pairs(start: usize, n: usize) -> f64 {
    let (s, n) = (start as f64, n as f64);
    n * s + n * (n + 1.0) / 2.0
}

/// A step's size as the cost model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    pub tokens: usize,
    pub pairs: f64,
    pub rows: usize,
}

impl StepShape {
    /// One request's chunk of `n` tokens after `start` cached ones.
    pub fn add_chunk(&mut self, start: usize, n: usize) {
        self.tokens += n;
        self.pairs += chunk_pairs(start, n);
        self.rows += 1;
    }
}

/// Old steps weigh `FORGET^age`: the fit follows a machine whose speed changes (other
/// processes, thermal limits) within a hundred steps.
const FORGET: f64 = 0.98;

#[derive(Clone, Debug)]
pub struct StepCost {
    /// `[fixed, per_token, per_pair, per_row]` in seconds (of the scaled features).
    theta: [f64; N],
    /// The inverse covariance of the fit (recursive least squares).
    p: [[f64; N]; N],
}

const N: usize = 4;

/// The most any term's variance may grow to between informative steps.
const MAX_VARIANCE: f64 = 10.0;

fn features(s: StepShape) -> [f64; N] {
    // Scaled to one order: tokens in thousands, pairs in millions, rows in hundreds.
    [
        1.0,
        s.tokens as f64 / 1e3,
        s.pairs / 1e6,
        s.rows as f64 / 1e2,
    ]
}

fn identity(scale: f64) -> [[f64; N]; N] {
    std::array::from_fn(|i| std::array::from_fn(|j| if i == j { scale } else { 0.0 }))
}

impl StepCost {
    /// The least-squares fit of timed steps (at least one), every term non-negative: a term
    /// the samples would make negative (noise, too few sizes) is left out and the rest refit.
    /// Start-up steps have one request each, so the per-row term is learnt in service.
    pub fn fit(samples: &[(StepShape, f64)]) -> Self {
        let (t, f) = (true, false);
        // Terms kept, most first: all, then without attention pairs, then per token only.
        for keep in [[t, t, t, f], [t, t, f, f], [f, t, f, f]] {
            let mut c = Self::fit_terms(samples, keep);
            if c.theta.iter().all(|v| *v >= 0.0 && v.is_finite()) {
                // A prior only: the steps of serving, under the load it brings, soon weigh
                // more than the start-up fit.
                c.p = identity(1.0);
                return c;
            }
        }
        let (tokens, secs) = samples
            .iter()
            .fold((0.0, 0.0), |(n, t), (s, x)| (n + s.tokens as f64, t + x));
        Self {
            theta: [0.0, secs / tokens.max(1.0) * 1e3, 0.0, 0.0],
            p: identity(1.0),
        }
    }

    /// The fit of the `keep` terms (the others held at 0).
    fn fit_terms(samples: &[(StepShape, f64)], keep: [bool; N]) -> Self {
        let mut p = identity(1e6);
        for i in 0..N {
            if !keep[i] {
                p[i][i] = 0.0;
            }
        }
        let mut c = Self { theta: [0.0; N], p };
        for &(s, t) in samples {
            c.update(s, t, 1.0);
        }
        c
    }

    /// Predicted seconds of a step of this shape.
    pub fn predict(&self, s: StepShape) -> f64 {
        let x = features(s);
        (0..N).map(|i| self.theta[i] * x[i]).sum::<f64>().max(0.0)
    }

    /// Folds a measured step into the fit.
    pub fn observe(&mut self, s: StepShape, seconds: f64) {
        if !(seconds.is_finite() && seconds > 0.0 && s.tokens > 0) {
            return;
        }
        self.update(s, seconds, FORGET);
        // Projected onto non-negative terms: noise on near-collinear features (a lone
        // request's fixed and per-request costs) must not drive one term below zero and
        // another up, which would predict free steps.
        self.theta.iter_mut().for_each(|t| *t = t.max(0.0));
        // Forgetting inflates what steps leave unexplored (a feature that stays constant):
        // bounded, so one unusual step cannot swing the fit.
        for i in 0..N {
            if self.p[i][i] > MAX_VARIANCE {
                let scale = (MAX_VARIANCE / self.p[i][i]).sqrt();
                for j in 0..N {
                    self.p[i][j] *= scale;
                    self.p[j][i] *= scale;
                }
            }
        }
    }

    fn update(&mut self, s: StepShape, y: f64, lambda: f64) {
        let x = features(s);
        let px: [f64; N] = std::array::from_fn(|i| (0..N).map(|j| self.p[i][j] * x[j]).sum());
        let denom = lambda + (0..N).map(|i| x[i] * px[i]).sum::<f64>();
        let k: [f64; N] = std::array::from_fn(|i| px[i] / denom);
        let err = y - (0..N).map(|i| self.theta[i] * x[i]).sum::<f64>();
        for (t, k) in self.theta.iter_mut().zip(k) {
            *t += k * err;
        }
        let old = self.p;
        for i in 0..N {
            for j in 0..N {
                self.p[i][j] = (old[i][j] - k[i] * px[j]) / lambda;
            }
        }
    }

    /// The most tokens of a chunk after `start` cached ones that keep a step now of shape
    /// `base` within `target` seconds (0 when even the base is over it).
    pub fn chunk_within(&self, base: StepShape, start: usize, max: usize, target: f64) -> usize {
        let fits = |n: usize| {
            let mut s = base;
            s.add_chunk(start, n);
            self.predict(s) <= target
        };
        if !fits(1) {
            return 0;
        }
        let (mut lo, mut hi) = (1, max);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            match fits(mid) {
                true => lo = mid,
                false => hi = mid - 1,
            }
        }
        lo
    }

    /// The terms in ms, for the start-up log line.
    pub fn describe(&self) -> String {
        let [a, b, c, d] = self.theta;
        format!(
            "step ~ {:.2} ms + {:.3} ms/token + {:.2} ms per million attended pairs + {:.3} ms/request",
            a * 1e3,
            b,
            c * 1e3,
            d * 10.0
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(tokens: usize, start: usize) -> StepShape {
        let mut s = StepShape::default();
        s.add_chunk(start, tokens);
        s
    }

    #[test]
    fn the_fit_recovers_a_linear_cost_and_follows_a_change() {
        let truth = |s: StepShape| 0.004 + 0.0008 * s.tokens as f64 + 2e-9 * s.pairs;
        let samples: Vec<_> = [(1, 0), (16, 0), (64, 200), (512, 0), (256, 1000)]
            .iter()
            .map(|&(n, at)| (shape(n, at), truth(shape(n, at))))
            .collect();
        let mut c = StepCost::fit(&samples);
        for &(s, t) in &samples {
            assert!((c.predict(s) / t - 1.0).abs() < 0.01, "{}", c.describe());
        }
        // Half the speed: after a few hundred steps, predictions follow.
        for i in 0..600 {
            let s = shape(1 + (i * 37) % 500, (i * 11) % 900);
            c.observe(s, 2.0 * truth(s));
        }
        let s = shape(300, 100);
        assert!(
            (c.predict(s) / (2.0 * truth(s)) - 1.0).abs() < 0.02,
            "{}",
            c.describe()
        );
    }

    #[test]
    fn a_chunk_is_cut_to_the_target() {
        let truth = |s: StepShape| 0.001 + 0.0008 * s.tokens as f64;
        let shapes = [shape(1, 0), shape(64, 0), shape(64, 2000), shape(512, 0)];
        let c = StepCost::fit(&shapes.map(|s| (s, truth(s))));
        // 1 ms a step, 0.8 ms a token: 50 ms fit about 60 tokens beside a decode.
        let decode = shape(1, 100);
        let n = c.chunk_within(decode, 0, 512, 0.050);
        assert!((58..=61).contains(&n), "{n}");
        assert_eq!(c.chunk_within(decode, 0, 512, 10.0), 512);
        assert_eq!(c.chunk_within(shape(200, 0), 0, 512, 0.050), 0);
    }
}
