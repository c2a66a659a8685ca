//! The engine loop: schedule, execute, update, stream — on a thread of its own, driven by
//! commands from any number of async clients through [`EngineHandle`].

use crate::detokenizer::IncrementalDetokenizer;
use crate::output::{RequestOutput, StepOutput, TokenLogprob};
use crate::request::{FinishReason, Request, RequestId};
use crate::sampling::SamplingParams;
use crate::scheduler::{AdmissionError, Scheduler, SchedulerConfig, SchedulerOutput};
use crate::stop::StopStrings;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;
use tokenizers::Tokenizer;
use tokio::sync::mpsc as tokio_mpsc;

pub type ExecError = Box<dyn std::error::Error + Send + Sync>;

/// Runs a scheduled step on the model. Implemented by the model runner.
pub trait Executor: Send {
    fn execute(&mut self, step: &SchedulerOutput) -> Result<StepOutput, ExecError>;
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    InvalidParams(String),
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error("the engine is not running")]
    Dead,
    #[error("the model step failed: {0}")]
    Step(String),
}

impl EngineError {
    /// True for errors caused by the request itself (HTTP 400), false for server faults.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            EngineError::InvalidParams(_) | EngineError::Admission(_)
        )
    }
}

type OutputSink = tokio_mpsc::UnboundedSender<Result<RequestOutput, EngineError>>;

enum Command {
    Add(Request, OutputSink),
    Abort(RequestId),
    ResetPrefixCache,
    Shutdown,
}

/// Counters the engine publishes after every step.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub kv_usage: f64,
    pub num_preemptions: u64,
    pub num_steps: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Prompt tokens looked up in the prefix cache, and found there.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub alive: bool,
}

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
}

/// The synchronous core: owns the scheduler and the executor. Public so tests and
/// offline benchmarks can drive it step by step.
pub struct EngineCore<E: Executor> {
    scheduler: Scheduler,
    executor: E,
    tokenizer: Arc<Tokenizer>,
    states: HashMap<RequestId, RequestState>,
    stats: Arc<Mutex<EngineStats>>,
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

    fn add(&mut self, req: Request, sink: OutputSink) {
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
            },
        );
        self.stats.lock().unwrap().prompt_tokens_total += req.num_prompt_tokens() as u64;
        self.scheduler.add_request(req);
    }

    pub fn abort(&mut self, id: RequestId) {
        self.scheduler.finish(id, FinishReason::Abort);
        self.states.remove(&id);
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
        for r in &output.requests {
            if let Some(st) = self.states.get_mut(&r.req_id) {
                st.queue_time
                    .get_or_insert_with(|| st.arrival.elapsed().as_secs_f64());
            }
        }
        if output.is_empty() {
            self.publish_stats();
            return !self.scheduler.has_work();
        }
        // A panic in the model (a bug, never bad input) fails this step's requests and leaves
        // the engine serving the others.
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
            Ok(result) => self.apply(&output, result),
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
        for (id, lps) in result.prompt_logprobs.drain() {
            if let Some(Some(v)) = self.states.get_mut(&id).map(|s| s.prompt_logprobs.as_mut()) {
                v.extend(lps.into_iter().map(Some));
            }
        }
        let tokens: HashMap<RequestId, u32> = result
            .sampled
            .iter()
            .map(|(&id, s)| (id, s.token_id))
            .collect();
        let updates = self.scheduler.update(output, &tokens);
        let mut generated = 0u64;
        for u in updates {
            let Some(token) = u.new_token else { continue };
            generated += 1;
            let Some(st) = self.states.get_mut(&u.req_id) else {
                continue;
            };
            st.num_output_tokens += 1;
            let piece = st.detok.push(&self.tokenizer, token);
            let mut check = st.stop.push(&piece);
            let mut finish = u.finished;
            if check.stopped {
                finish = Some(FinishReason::Stop);
                self.scheduler.finish(u.req_id, FinishReason::Stop);
            } else if finish.is_some() {
                let tail = st.detok.flush(&self.tokenizer);
                let c = st.stop.push(&tail);
                check.text += &c.text;
                if !c.stopped {
                    check.text += &st.stop.flush();
                }
            }
            let sampled = result.sampled.remove(&u.req_id);
            let out = RequestOutput {
                text: check.text,
                token_ids: vec![token],
                logprobs: sampled.and_then(|s| s.logprobs).into_iter().collect(),
                prompt_logprobs: if st.first_output_sent || !st.wants_prompt_logprobs {
                    None
                } else {
                    st.prompt_logprobs.take()
                },
                finish_reason: finish,
                num_prompt_tokens: st.num_prompt_tokens,
                num_output_tokens: st.num_output_tokens,
                queue_time: if st.first_output_sent {
                    None
                } else {
                    st.queue_time
                },
            };
            st.first_output_sent = true;
            let delivered = st.sink.send(Ok(out)).is_ok();
            if finish.is_some() {
                self.states.remove(&u.req_id);
            } else if !delivered {
                self.abort(u.req_id);
            }
        }
        self.stats.lock().unwrap().generation_tokens_total += generated;
    }

    fn publish_stats(&self) {
        let mut s = self.stats.lock().unwrap();
        s.num_running = self.scheduler.num_running();
        s.num_waiting = self.scheduler.num_waiting();
        s.kv_usage = self.scheduler.kv_usage();
        s.num_preemptions = self.scheduler.num_preemptions();
        (s.prefix_cache_queries, s.prefix_cache_hits) = self.scheduler.prefix_cache_stats();
        s.num_steps += 1;
    }

    fn fail_all(&mut self, err: impl Fn() -> EngineError) {
        for (id, st) in self.states.drain() {
            let _ = st.sink.send(Err(err()));
            self.scheduler.finish(id, FinishReason::Abort);
        }
    }
}

/// Static facts a client needs to validate requests before they reach the engine thread.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub max_model_len: usize,
    pub prefix_caching: bool,
    pub eos_token_ids: Arc<[u32]>,
}

/// Cheap to clone; every clone talks to the same engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    info: EngineInfo,
    /// A scheduler twin with the same config, used only for admission checks.
    admission: Arc<Scheduler>,
    stats: Arc<Mutex<EngineStats>>,
    tokenizer: Arc<Tokenizer>,
}

/// The stream of outputs of one request. Dropping it before the end aborts the request.
pub struct RequestStream {
    pub id: RequestId,
    rx: tokio_mpsc::UnboundedReceiver<Result<RequestOutput, EngineError>>,
    commands: mpsc::Sender<Command>,
    finished: bool,
}

impl RequestStream {
    pub async fn next(&mut self) -> Option<Result<RequestOutput, EngineError>> {
        let item = self.rx.recv().await;
        self.note(&item);
        item
    }

    /// For callers outside an async runtime.
    pub fn blocking_next(&mut self) -> Option<Result<RequestOutput, EngineError>> {
        let item = self.rx.blocking_recv();
        self.note(&item);
        item
    }

    fn note(&mut self, item: &Option<Result<RequestOutput, EngineError>>) {
        match item {
            Some(Ok(o)) if o.finish_reason.is_none() => {}
            _ => self.finished = true,
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}

impl EngineHandle {
    /// Starts the engine loop on its own thread.
    pub fn spawn<E: Executor + 'static>(
        config: SchedulerConfig,
        executor: E,
        tokenizer: Arc<Tokenizer>,
        eos_token_ids: Vec<u32>,
    ) -> Self {
        let (tx, rx) = mpsc::channel::<Command>();
        let info = EngineInfo {
            max_model_len: config.max_model_len,
            prefix_caching: config.prefix_caching.is_some(),
            eos_token_ids: eos_token_ids.into(),
        };
        let admission = Arc::new(Scheduler::new(config.clone()));
        let mut core = EngineCore::new(config, executor, tokenizer.clone());
        let stats = core.stats.clone();
        std::thread::Builder::new()
            .name("ferrite-engine".into())
            .spawn(move || run_loop(&mut core, rx))
            .expect("spawn engine thread");
        Self {
            commands: tx,
            next_id: Arc::new(AtomicU64::new(0)),
            info,
            admission,
            stats,
            tokenizer,
        }
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn stats(&self) -> EngineStats {
        self.stats.lock().unwrap().clone()
    }

    /// Validates and queues a request; outputs arrive on the returned stream.
    pub fn add_request(
        &self,
        prompt_token_ids: Vec<u32>,
        params: SamplingParams,
    ) -> Result<RequestStream, EngineError> {
        params.validate().map_err(EngineError::InvalidParams)?;
        if let Some(&bad) = prompt_token_ids
            .iter()
            .find(|&&t| t as usize >= self.tokenizer.get_vocab_size(true))
        {
            return Err(EngineError::InvalidParams(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        let max_out = self
            .admission
            .check_admissible(prompt_token_ids.len(), &params)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let req = Request::new(
            id,
            prompt_token_ids,
            Arc::new(params),
            max_out,
            self.info.eos_token_ids.clone(),
        );
        let (tx, rx) = tokio_mpsc::unbounded_channel();
        self.commands
            .send(Command::Add(req, tx))
            .map_err(|_| EngineError::Dead)?;
        Ok(RequestStream {
            id,
            rx,
            commands: self.commands.clone(),
            finished: false,
        })
    }

    pub fn abort(&self, id: RequestId) {
        let _ = self.commands.send(Command::Abort(id));
    }

    /// Forgets every cached prefix (the admin route `/reset_prefix_cache`).
    pub fn reset_prefix_cache(&self) -> Result<(), EngineError> {
        self.commands
            .send(Command::ResetPrefixCache)
            .map_err(|_| EngineError::Dead)
    }

    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }
}

fn run_loop<E: Executor>(core: &mut EngineCore<E>, rx: mpsc::Receiver<Command>) {
    let handle = |core: &mut EngineCore<E>, cmd: Command| -> bool {
        match cmd {
            Command::Add(req, sink) => core.add(req, sink),
            Command::Abort(id) => core.abort(id),
            Command::ResetPrefixCache => core.scheduler.reset_prefix_cache(),
            Command::Shutdown => return false,
        }
        true
    };
    'outer: loop {
        if !core.has_work() {
            match rx.recv() {
                Ok(cmd) => {
                    if !handle(core, cmd) {
                        break;
                    }
                }
                Err(_) => break,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            if !handle(core, cmd) {
                break 'outer;
            }
        }
        core.step();
    }
    core.fail_all(|| EngineError::Dead);
    core.stats.lock().unwrap().alive = false;
}
