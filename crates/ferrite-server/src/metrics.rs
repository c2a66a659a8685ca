//! Prometheus metrics with vLLM's names and meanings, so existing dashboards work.

use ferrite_core::engine::{EngineInfo, EngineStats, ITERATION_TOKEN_BUCKETS};
use std::fmt::Write;
use std::sync::Mutex;

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

#[derive(Default, Clone)]
struct Histogram {
    /// `LATENCY_BUCKETS` unless set.
    buckets: Option<&'static [f64]>,
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn of(buckets: &'static [f64]) -> Self {
        Self {
            buckets: Some(buckets),
            ..Self::default()
        }
    }

    fn bounds(&self) -> &'static [f64] {
        self.buckets.unwrap_or(LATENCY_BUCKETS)
    }

    fn observe(&mut self, v: f64) {
        let bounds = self.bounds();
        if self.counts.is_empty() {
            self.counts = vec![0; bounds.len()];
        }
        for (i, b) in bounds.iter().enumerate() {
            if v <= *b {
                self.counts[i] += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in self.bounds().iter().enumerate() {
            let c = self.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// vLLM's buckets of the per-request token-count histograms.
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0,
];

#[derive(Default)]
struct Inner {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
    prefill: Histogram,
    decode: Histogram,
    prompt_tokens: Histogram,
    generation_tokens: Histogram,
    success: std::collections::BTreeMap<&'static str, u64>,
}

pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                prompt_tokens: Histogram::of(TOKEN_BUCKETS),
                generation_tokens: Histogram::of(TOKEN_BUCKETS),
                ..Inner::default()
            }),
        }
    }
}

/// Timeline of one finished request, as the server saw it.
pub struct RequestTimes {
    pub queue: f64,
    pub ttft: f64,
    pub itls: Vec<f64>,
    pub e2e: f64,
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    pub generation_tokens: usize,
}

impl Metrics {
    pub fn record(&self, t: &RequestTimes) {
        let mut m = self.inner.lock().unwrap();
        m.ttft.observe(t.ttft);
        m.queue.observe(t.queue);
        for &g in &t.itls {
            m.itl.observe(g);
        }
        m.e2e.observe(t.e2e);
        // vLLM's phases: prefill from the first step to the first token, decode after it.
        m.prefill.observe((t.ttft - t.queue).max(0.0));
        m.decode.observe((t.e2e - t.ttft).max(0.0));
        m.prompt_tokens.observe(t.prompt_tokens as f64);
        m.generation_tokens.observe(t.generation_tokens as f64);
        *m.success.entry(t.finish_reason).or_default() += 1;
    }

    pub fn render(&self, model: &str, s: &EngineStats, info: &EngineInfo) -> String {
        let l = format!("model_name=\"{model}\"");
        let mut out = String::new();
        let gauges = [
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                s.num_running as f64,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                s.num_waiting as f64,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                s.kv_usage,
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{l}}} {v}"
            );
        }
        let counters = [
            (
                "vllm:num_preemptions_total",
                "Cumulative number of preemptions from the engine.",
                s.num_preemptions,
            ),
            (
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
                s.prompt_tokens_total,
            ),
            (
                "ferrite:prompt_tokens_computed_total",
                "Prompt tokens run through the model: prefill tokens less prefix-cache hits.",
                s.prompt_tokens_computed,
            ),
            (
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
                s.generation_tokens_total,
            ),
            (
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                s.prefix_cache_hits,
            ),
            (
                "vllm:spec_decode_num_drafts_total",
                "Number of spec decoding drafts.",
                s.spec.num_drafts,
            ),
            (
                "vllm:spec_decode_num_draft_tokens_total",
                "Number of draft tokens.",
                s.spec.num_draft_tokens,
            ),
            (
                "vllm:spec_decode_num_accepted_tokens_total",
                "Number of accepted tokens.",
                s.spec.num_accepted_tokens,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{l}}} {v}"
            );
        }
        let _ = writeln!(out, "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.\n# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter");
        for (pos, v) in s.spec.accepted_per_pos.iter().enumerate() {
            let _ = writeln!(
                out,
                "vllm:spec_decode_num_accepted_tokens_per_pos_total{{{l},position=\"{pos}\"}} {v}"
            );
        }
        self.render_requests(&mut out, &l, s);
        render_iteration_tokens(&mut out, &l, s);
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"{}\",num_gpu_blocks=\"{}\",num_cpu_blocks=\"0\"}} 1.0",
            info.block_size,
            if info.prefix_caching { "True" } else { "False" },
            info.num_blocks,
        );
        out
    }

    /// Finished requests by reason, and the per-request histograms.
    fn render_requests(&self, out: &mut String, l: &str, s: &EngineStats) {
        let m = self.inner.lock().unwrap();
        let _ = writeln!(out, "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter");
        for reason in ["stop", "length", "abort"] {
            // Aborted requests never reach the server's own count: the engine keeps it.
            let v = match reason {
                "abort" => s.aborted_total,
                _ => m.success.get(reason).copied().unwrap_or(0),
            };
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} {v}"
            );
        }
        let histograms = [
            (
                &m.ttft,
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
            ),
            (
                &m.itl,
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
            ),
            (
                &m.e2e,
                "vllm:e2e_request_latency_seconds",
                "Histogram of end to end request latency in seconds.",
            ),
            (
                &m.queue,
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
            ),
            (
                &m.itl,
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
            ),
            (
                &m.prefill,
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
            ),
            (
                &m.decode,
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
            ),
            (
                &m.prompt_tokens,
                "vllm:request_prompt_tokens",
                "Number of prefill tokens processed.",
            ),
            (
                &m.generation_tokens,
                "vllm:request_generation_tokens",
                "Number of generation tokens processed.",
            ),
        ];
        for (h, name, help) in histograms {
            h.render(out, name, help, l);
        }
    }
}

/// Tokens per engine step, as vLLM's histogram.
fn render_iteration_tokens(out: &mut String, l: &str, s: &EngineStats) {
    let name = "vllm:iteration_tokens_total";
    let _ = writeln!(
        out,
        "# HELP {name} Histogram of number of tokens per engine_step.\n# TYPE {name} histogram"
    );
    for (count, le) in s.iteration_tokens.iter().zip(ITERATION_TOKEN_BUCKETS) {
        let _ = writeln!(out, "{name}_bucket{{{l},le=\"{le}.0\"}} {count}");
    }
    let n = s.iteration_tokens_count;
    let _ = writeln!(out, "{name}_bucket{{{l},le=\"+Inf\"}} {n}");
    let _ = writeln!(out, "{name}_sum{{{l}}} {}.0", s.iteration_tokens_sum);
    let _ = writeln!(out, "{name}_count{{{l}}} {n}");
}
