//! What a step costs in time: `fixed + per_token * tokens + per_pair * pairs + per_row * rows`,
//! where `pairs` counts the (query, key) pairs attention computes and `rows` the requests
//! (each with its logits row and its sampling). Fitted at start-up from timed steps
//! and refitted online from every step the engine runs (least squares that forgets old
//! steps), so the scheduler can size a step's prefill share to keep running
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

const N: usize = 4;

/// The fit: exponentially weighted least squares over every step seen, solved exactly at
/// each step with every term non-negative. (Recursive least squares, which carries an
/// inverse covariance instead, diverged in service: clamping its terms to non-negative
/// values left that covariance inconsistent, and predictions grew 1,000-fold in 40 steps.)
#[derive(Clone, Debug)]
pub struct StepCost {
    /// `[fixed, per_token, per_pair, per_row]` in seconds (of the scaled features).
    theta: [f64; N],
    /// The weighted sums `sum x x^T`, `sum x y` and `sum y^2` over the steps seen.
    xx: [[f64; N]; N],
    xy: [f64; N],
    yy: f64,
}

fn features(s: StepShape) -> [f64; N] {
    // Scaled to one order: tokens in thousands, pairs in millions, rows in hundreds.
    [
        1.0,
        s.tokens as f64 / 1e3,
        s.pairs / 1e6,
        s.rows as f64 / 1e2,
    ]
}

impl StepCost {
    /// The least-squares fit of timed steps (at least one), every term non-negative.
    /// Start-up steps have one request each, so the per-row term is learnt in service.
    pub fn fit(samples: &[(StepShape, f64)]) -> Self {
        let mut c = Self {
            theta: [0.0; N],
            xx: [[0.0; N]; N],
            xy: [0.0; N],
            yy: 0.0,
        };
        for &(s, t) in samples {
            c.add(s, t, 1.0);
        }
        c.solve();
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
        self.add(s, seconds, FORGET);
        self.solve();
    }

    fn add(&mut self, s: StepShape, y: f64, keep: f64) {
        let x = features(s);
        for i in 0..N {
            for j in 0..N {
                self.xx[i][j] = keep * self.xx[i][j] + x[i] * x[j];
            }
            self.xy[i] = keep * self.xy[i] + x[i] * y;
        }
        self.yy = keep * self.yy + y * y;
    }

    /// Non-negative least squares by trying every subset of the terms (15 systems of at
    /// most 4 unknowns): the feasible solution with the least weighted squared error. A
    /// subset the steps cannot tell apart (a singular system) is skipped.
    fn solve(&mut self) {
        let mut best: Option<(f64, [f64; N])> = None;
        for mask in 1u32..(1 << N) {
            let terms: Vec<usize> = (0..N).filter(|i| mask >> i & 1 == 1).collect();
            let Some(sub) = solve_terms(&self.xx, &self.xy, &terms) else {
                continue;
            };
            let mut theta = [0.0; N];
            for (&i, v) in terms.iter().zip(sub) {
                theta[i] = v;
            }
            if theta.iter().any(|v| *v < 0.0 || !v.is_finite()) {
                continue;
            }
            let err = self.yy - 2.0 * dot(&theta, &self.xy)
                + (0..N)
                    .map(|i| theta[i] * dot(&self.xx[i], &theta))
                    .sum::<f64>();
            if best.is_none_or(|(e, _)| err < e) {
                best = Some((err, theta));
            }
        }
        if let Some((_, theta)) = best {
            self.theta = theta;
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

fn dot(a: &[f64; N], b: &[f64; N]) -> f64 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

/// The normal equations restricted to `terms`, solved by Gaussian elimination with partial
/// pivoting; `None` when they are (nearly) singular.
fn solve_terms(xx: &[[f64; N]; N], xy: &[f64; N], terms: &[usize]) -> Option<Vec<f64>> {
    let n = terms.len();
    let mut m: Vec<Vec<f64>> = terms
        .iter()
        .map(|&i| {
            let mut row: Vec<f64> = terms.iter().map(|&j| xx[i][j]).collect();
            row.push(xy[i]);
            row
        })
        .collect();
    let scale = terms.iter().map(|&i| xx[i][i]).fold(0.0, f64::max);
    for c in 0..n {
        let p = (c..n).max_by(|&a, &b| m[a][c].abs().total_cmp(&m[b][c].abs()))?;
        if m[p][c].abs() <= 1e-9 * scale {
            return None;
        }
        m.swap(c, p);
        let pivot = m[c].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != c {
                let f = row[c] / pivot[c];
                for (x, p) in row[c..].iter_mut().zip(&pivot[c..]) {
                    *x -= f * p;
                }
            }
        }
    }
    Some((0..n).map(|r| m[r][n] / m[r][r]).collect())
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

    #[test]
    fn the_fit_follows_a_real_run_without_running_away() {
        // Every step of a served run (agent mini at C = 1, 2, 4, 8 on a 2-core EPYC):
        // tokens, requests, millions of attended pairs, milliseconds. Refitted after each,
        // as in service; recursive least squares diverged on these (predictions 10^5 times
        // the measured times by C = 8).
        let steps: Vec<(StepShape, f64)> = include_str!("../tests/data/steps-epyc.csv")
            .lines()
            .map(|l| {
                let v: Vec<f64> = l.split(',').map(|x| x.parse().unwrap()).collect();
                let s = StepShape {
                    tokens: v[0] as usize,
                    rows: v[1] as usize,
                    pairs: v[2] * 1e6,
                };
                (s, v[3] / 1e3)
            })
            .collect();
        let mut c = StepCost::fit(&steps[..4]);
        let mut ratios: Vec<f64> = steps[4..]
            .iter()
            .map(|&(s, t)| {
                let r = c.predict(s) / t;
                c.observe(s, t);
                r
            })
            .collect();
        ratios.sort_by(f64::total_cmp);
        let q = |f: f64| ratios[((ratios.len() - 1) as f64 * f) as usize];
        let (p1, p50, p99, max) = (q(0.01), q(0.5), q(0.99), ratios[ratios.len() - 1]);
        assert!(
            p1 > 0.5 && (0.8..1.25).contains(&p50) && p99 < 2.0 && max < 3.0,
            "predicted / measured: p1 {p1:.2}, p50 {p50:.2}, p99 {p99:.2}, max {max:.2}"
        );
    }
}
