//! Latency arithmetic with the definitions of vLLM's `benchmark_serving`.

use serde::Serialize;

/// What one streamed request looked like from the client.
#[derive(Clone, Debug, Default)]
pub struct RequestRecord {
    pub ok: bool,
    pub error: Option<String>,
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// Seconds from send to the first content chunk.
    pub ttft: f64,
    /// Gaps between consecutive content chunks.
    pub itls: Vec<f64>,
    pub e2e: f64,
}

impl RequestRecord {
    /// Time per output token after the first: `(e2e - ttft) / (output_tokens - 1)`.
    pub fn tpot(&self) -> Option<f64> {
        (self.output_tokens > 1).then(|| (self.e2e - self.ttft) / (self.output_tokens - 1) as f64)
    }
}

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Summary {
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
}

/// Percentile with linear interpolation between closest ranks (numpy's default).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

pub fn summarize(values: &[f64]) -> Summary {
    if values.is_empty() {
        return Summary::default();
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    Summary {
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: percentile(&v, 50.0),
        p99: percentile(&v, 99.0),
    }
}

/// One concurrency level's results.
#[derive(Clone, Debug, Serialize)]
pub struct LevelResult {
    pub concurrency: usize,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub ttft_s: Summary,
    pub tpot_s: Summary,
    pub itl_s: Summary,
    pub e2e_s: Summary,
    pub errors: Vec<String>,
    /// Per request, in completion order: (input tokens, TTFT s).
    pub requests: Vec<(usize, f64)>,
}

pub fn level_result(concurrency: usize, records: &[RequestRecord], duration_s: f64) -> LevelResult {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok).collect();
    let out_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
    let itls: Vec<f64> = ok.iter().flat_map(|r| r.itls.iter().copied()).collect();
    LevelResult {
        concurrency,
        completed: ok.len(),
        failed: records.len() - ok.len(),
        duration_s,
        total_input_tokens: ok.iter().map(|r| r.input_tokens).sum(),
        total_output_tokens: out_tokens,
        request_throughput: ok.len() as f64 / duration_s,
        output_throughput: out_tokens as f64 / duration_s,
        ttft_s: summarize(&ok.iter().map(|r| r.ttft).collect::<Vec<_>>()),
        tpot_s: summarize(&ok.iter().filter_map(|r| r.tpot()).collect::<Vec<_>>()),
        itl_s: summarize(&itls),
        e2e_s: summarize(&ok.iter().map(|r| r.e2e).collect::<Vec<_>>()),
        errors: records
            .iter()
            .filter_map(|r| r.error.clone())
            .take(5)
            .collect(),
        requests: ok.iter().map(|r| (r.input_tokens, r.ttft)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ttft: f64, gaps: &[f64]) -> RequestRecord {
        RequestRecord {
            ok: true,
            input_tokens: 10,
            output_tokens: gaps.len() + 1,
            ttft,
            itls: gaps.to_vec(),
            e2e: ttft + gaps.iter().sum::<f64>(),
            error: None,
        }
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(
            summarize(&[3.0, 1.0, 2.0]),
            Summary {
                mean: 2.0,
                p50: 2.0,
                p99: 2.98
            }
        );
    }

    #[test]
    fn synthetic_timelines() {
        // Request A: first token at 0.5 s, then 3 tokens 0.1 s apart. B: 1.0 s, then 0.2 s, 0.4 s.
        let a = rec(0.5, &[0.1, 0.1, 0.1]);
        let b = rec(1.0, &[0.2, 0.4]);
        assert!((a.tpot().unwrap() - 0.1).abs() < 1e-12);
        assert!((b.tpot().unwrap() - 0.3).abs() < 1e-12);
        let mut failed = rec(0.1, &[]);
        failed.ok = false;
        failed.error = Some("HTTP 500".into());
        let l = level_result(2, &[a, b, failed], 2.0);
        assert_eq!((l.completed, l.failed), (2, 1));
        assert_eq!(l.total_output_tokens, 7);
        assert!((l.output_throughput - 3.5).abs() < 1e-12);
        assert!((l.request_throughput - 1.0).abs() < 1e-12);
        assert!((l.ttft_s.mean - 0.75).abs() < 1e-12);
        // ITL pools the five gaps of both requests: mean 0.18, median 0.1.
        assert!((l.itl_s.mean - 0.18).abs() < 1e-12);
        assert!((l.itl_s.p50 - 0.1).abs() < 1e-12);
        assert!((l.tpot_s.mean - 0.2).abs() < 1e-12);
        assert!((l.e2e_s.mean - (0.8 + 1.6) / 2.0).abs() < 1e-12);
        assert_eq!(l.errors, vec!["HTTP 500".to_string()]);
    }
}
