//! The synchronous engine core: scheduler and executor, each step's results turned into
//! detokenized, stop-checked request outputs.

use super::contract::{EngineError, EngineStats, Executor, OutputSink, ITERATION_TOKEN_BUCKETS};
use crate::detokenizer::IncrementalDetokenizer;
use crate::output::{RequestOutput, SampledToken, StepOutput, TokenLogprob};
use crate::request::{FinishReason, Request, RequestId};
use crate::scheduler::{RequestUpdate, Scheduler, SchedulerConfig, SchedulerOutput};
use crate::stop::StopStrings;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokenizers::Tokenizer;

struct RequestState {
    sink: OutputSink,
    detok: IncrementalDetokenizer,
    stop: StopStrings,
    num_prompt_tokens: usize,
    num_output_tokens: usize,
    prompt_logprobs: Option<Vec<Option<TokenLogprob>>>,
    wants_prompt_logprobs: bool,
    first_output_sent: bool,
    arrival: Instant,
    queue_time: Option<f64>,
    /// Where its first step started: the prompt tokens the prefix cache served.
    num_cached_tokens: usize,
}

/// The synchronous core: owns the scheduler and the executor. Public so tests and
/// offline benchmarks can drive it step by step.
pub struct EngineCore<E: Executor> {
    pub(super) scheduler: Scheduler,
    executor: E,
    tokenizer: Arc<Tokenizer>,
    states: HashMap<RequestId, RequestState>,
    pub(super) stats: Arc<Mutex<EngineStats>>,
}

impl<E: Executor> EngineCore<E> {
    pub fn new(config: SchedulerConfig, executor: E, tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            scheduler: Scheduler::new(config),
            executor,
            tokenizer,
            states: HashMap::new(),
            stats: Arc::new(Mutex::new(EngineStats {
                alive: true,
                ..Default::default()
            })),
        }
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn executor_mut(&mut self) -> &mut E {
        &mut self.executor
    }

    pub(super) fn add(&mut self, req: Request, sink: OutputSink) {
        let p = &req.params;
        self.states.insert(
            req.id,
            RequestState {
                sink,
                detok: IncrementalDetokenizer::new(&req.prompt_token_ids, p.skip_special_tokens),
                stop: StopStrings::new(p.stop.clone(), p.include_stop_str_in_output),
                num_prompt_tokens: req.num_prompt_tokens(),
                num_output_tokens: 0,
                prompt_logprobs: p.prompt_logprobs.map(|_| vec![None]),
                wants_prompt_logprobs: p.prompt_logprobs.is_some(),
                first_output_sent: false,
                arrival: Instant::now(),
                queue_time: None,
                num_cached_tokens: 0,
            },
        );
        self.stats.lock().unwrap().prompt_tokens_total += req.num_prompt_tokens() as u64;
        self.scheduler.add_request(req);
    }

    pub fn abort(&mut self, id: RequestId) {
        self.scheduler.finish(id, FinishReason::Abort);
        if self.states.remove(&id).is_some() {
            self.stats.lock().unwrap().aborted_total += 1;
        }
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Aborts requests whose client has gone away, so their blocks are free for this step.
    fn reap_disconnected(&mut self) {
        let gone: Vec<RequestId> = self
            .states
            .iter()
            .filter(|(_, s)| s.sink.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.abort(id);
        }
    }

    /// Runs one engine step. Returns false when there was nothing to do.
    pub fn step(&mut self) -> bool {
        self.reap_disconnected();
        let output = self.scheduler.schedule();
        let mut prompt_tokens = 0;
        for r in &output.requests {
            if let Some(st) = self.states.get_mut(&r.req_id) {
                if st.queue_time.is_none() {
                    st.queue_time = Some(st.arrival.elapsed().as_secs_f64());
                    st.num_cached_tokens = r.start_pos;
                }
                prompt_tokens += r
                    .seq_len()
                    .min(st.num_prompt_tokens)
                    .saturating_sub(r.start_pos);
            }
        }
        {
            let mut st = self.stats.lock().unwrap();
            st.prompt_tokens_computed += prompt_tokens as u64;
            let tokens: u64 = output
                .requests
                .iter()
                .map(|r| r.token_ids.len() as u64)
                .sum();
            if tokens > 0 {
                st.iteration_tokens_sum += tokens;
                st.iteration_tokens_count += 1;
                for (count, &le) in st.iteration_tokens.iter_mut().zip(&ITERATION_TOKEN_BUCKETS) {
                    *count += (tokens <= le) as u64;
                }
            }
        }
        if output.is_empty() {
            self.publish_stats();
            return !self.scheduler.has_work();
        }
        // A panic in the model (a bug, never bad input) fails this step's requests and leaves
        // the engine serving the others.
        let started = Instant::now();
        self.stats.lock().unwrap().step_started = Some(started);
        let executor = &mut self.executor;
        let run =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| executor.execute(&output)))
                .unwrap_or_else(|panic| {
                    let msg = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".into());
                    Err(format!("internal error in the model step: {msg}").into())
                });
        match run {
            Ok(result) => {
                self.scheduler
                    .observe_step(&output, started.elapsed().as_secs_f64());
                self.apply(&output, result)
            }
            Err(e) => {
                tracing::error!("model step failed: {e}");
                for s in &output.requests {
                    if let Some(st) = self.states.remove(&s.req_id) {
                        let _ = st.sink.send(Err(EngineError::Step(e.to_string())));
                    }
                    self.scheduler.finish(s.req_id, FinishReason::Abort);
                }
            }
        }
        self.publish_stats();
        true
    }

    fn apply(&mut self, output: &SchedulerOutput, mut result: StepOutput) {
        for (id, e) in result.failed.drain() {
            tracing::error!("request {id} failed in the model step: {e}");
            if let Some(st) = self.states.remove(&id) {
                let _ = st.sink.send(Err(EngineError::Step(e)));
            }
            self.scheduler.finish(id, FinishReason::Abort);
        }
        for (id, lps) in result.prompt_logprobs.drain() {
            if let Some(Some(v)) = self.states.get_mut(&id).map(|s| s.prompt_logprobs.as_mut()) {
                v.extend(lps.into_iter().map(Some));
            }
        }
        let tokens: HashMap<RequestId, Vec<u32>> = result
            .sampled
            .iter()
            .map(|(&id, s)| (id, s.iter().map(|t| t.token_id).collect()))
            .collect();
        let updates = self.scheduler.update(output, &tokens);
        self.scheduler
            .set_proposals(std::mem::take(&mut result.drafts));
        let mut generated = 0u64;
        for u in updates {
            if let Some(embedding) = result.pooled.remove(&u.req_id) {
                self.send_pooled(u.req_id, embedding);
                continue;
            }
            if u.new_tokens.is_empty() {
                if u.finished.is_some() {
                    // A pooling request the runner gave no vector: never left waiting.
                    if let Some(st) = self.states.remove(&u.req_id) {
                        let e = "the model step pooled nothing for this request";
                        let _ = st.sink.send(Err(EngineError::Step(e.into())));
                    }
                }
                continue;
            }
            let sampled = result.sampled.remove(&u.req_id).unwrap_or_default();
            generated += self.deliver(&u, sampled) as u64;
        }
        self.stats.lock().unwrap().generation_tokens_total += generated;
    }

    /// Streams a request's new tokens as text, cut at a stop string (tokens after it, in an
    /// accepted draft, are dropped); the number of tokens delivered.
    fn deliver(&mut self, u: &RequestUpdate, mut sampled: Vec<SampledToken>) -> usize {
        let Some(st) = self.states.get_mut(&u.req_id) else {
            return 0;
        };
        let mut text = String::new();
        let mut matched = None;
        let mut emitted = 0;
        for &token in &u.new_tokens {
            emitted += 1;
            let piece = st.detok.push(&self.tokenizer, token);
            let check = st.stop.push(&piece);
            text += &check.text;
            if check.matched.is_some() {
                matched = check.matched;
                break;
            }
        }
        let mut finish = u.finished;
        if matched.is_some() {
            finish = Some(FinishReason::Stop);
            self.scheduler.finish(u.req_id, FinishReason::Stop);
        } else if finish.is_some() {
            let tail = st.detok.flush(&self.tokenizer);
            let c = st.stop.push(&tail);
            text += &c.text;
            if c.matched.is_none() {
                text += &st.stop.flush();
            }
        }
        st.num_output_tokens += emitted;
        sampled.truncate(emitted);
        let out = RequestOutput {
            text,
            token_ids: u.new_tokens[..emitted].to_vec(),
            logprobs: sampled.into_iter().filter_map(|s| s.logprobs).collect(),
            prompt_logprobs: if st.first_output_sent || !st.wants_prompt_logprobs {
                None
            } else {
                st.prompt_logprobs.take()
            },
            finish_reason: finish,
            stop_str: matched,
            num_prompt_tokens: st.num_prompt_tokens,
            num_output_tokens: st.num_output_tokens,
            num_cached_tokens: st.num_cached_tokens,
            queue_time: if st.first_output_sent {
                None
            } else {
                st.queue_time
            },
            embedding: None,
        };
        st.first_output_sent = true;
        let delivered = st.sink.send(Ok(out)).is_ok();
        if finish.is_some() {
            self.states.remove(&u.req_id);
        } else if !delivered {
            self.abort(u.req_id);
        }
        emitted
    }

    /// A pooling request's one output; it finished in the scheduler's update.
    fn send_pooled(&mut self, id: RequestId, embedding: Vec<f32>) {
        let Some(st) = self.states.remove(&id) else {
            return;
        };
        let _ = st.sink.send(Ok(RequestOutput {
            finish_reason: Some(FinishReason::Stop),
            num_prompt_tokens: st.num_prompt_tokens,
            num_cached_tokens: st.num_cached_tokens,
            queue_time: st.queue_time,
            embedding: Some(embedding),
            ..RequestOutput::default()
        }));
    }

    fn publish_stats(&self) {
        let mut s = self.stats.lock().unwrap();
        s.step_started = None;
        s.num_running = self.scheduler.num_running();
        s.num_waiting = self.scheduler.num_waiting();
        s.kv_usage = self.scheduler.kv_usage();
        s.num_preemptions = self.scheduler.num_preemptions();
        (s.prefix_cache_queries, s.prefix_cache_hits) = self.scheduler.prefix_cache_stats();
        s.spec.clone_from(self.scheduler.spec_stats());
        s.num_steps += 1;
    }

    pub(super) fn fail_all(&mut self, err: impl Fn() -> EngineError) {
        for (id, st) in self.states.drain() {
            let _ = st.sink.send(Err(err()));
            self.scheduler.finish(id, FinishReason::Abort);
        }
    }
}
