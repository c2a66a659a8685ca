//! The engine thread and its clients: [`EngineHandle`] sends commands, [`RequestStream`]
//! receives a request's outputs and aborts it when dropped.

use super::contract::{Command, EngineError, EngineStats, Executor};
use super::core::EngineCore;
use crate::constraint::Constraint;
use crate::output::RequestOutput;
use crate::request::{Request, RequestId};
use crate::sampling::SamplingParams;
use crate::scheduler::{Scheduler, SchedulerConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use tokenizers::Tokenizer;
use tokio::sync::mpsc as tokio_mpsc;

/// Static facts a client needs to validate requests before they reach the engine thread.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub max_model_len: usize,
    pub prefix_caching: bool,
    pub eos_token_ids: Arc<[u32]>,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
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
    /// The engine thread, joined by [`EngineHandle::shutdown`].
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
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
            block_size: config.block_size,
            num_blocks: config.num_blocks,
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
        };
        let admission = Arc::new(Scheduler::new(config.clone()));
        let mut core = EngineCore::new(config, executor, tokenizer.clone());
        let stats = core.stats.clone();
        let thread = std::thread::Builder::new()
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
            thread: Arc::new(Mutex::new(Some(thread))),
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
        self.add_constrained(prompt_token_ids, params, None)
    }

    /// [`EngineHandle::add_request`] whose tokens follow `constraint` (structured output).
    pub fn add_constrained(
        &self,
        prompt_token_ids: Vec<u32>,
        params: SamplingParams,
        constraint: Option<Constraint>,
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
        let mut req = Request::new(
            id,
            prompt_token_ids,
            Arc::new(params),
            max_out,
            self.info.eos_token_ids.clone(),
        );
        req.constraint = constraint;
        self.submit(req)
    }

    fn submit(&self, req: Request) -> Result<RequestStream, EngineError> {
        let id = req.id;
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

    /// Queues a pooling request (embeddings, scores): its prompt is computed and its pooled
    /// hidden state is the one output; nothing is sampled.
    /// `token_type_ids`: each prompt token's segment, for pair inputs of cross-encoders.
    pub fn add_pooling(
        &self,
        prompt_token_ids: Vec<u32>,
        token_type_ids: Option<Vec<u32>>,
    ) -> Result<RequestStream, EngineError> {
        if token_type_ids
            .as_ref()
            .is_some_and(|t| t.len() != prompt_token_ids.len())
        {
            return Err(EngineError::InvalidParams(
                "one token type per prompt token".into(),
            ));
        }
        if let Some(&bad) = prompt_token_ids
            .iter()
            .find(|&&t| t as usize >= self.tokenizer.get_vocab_size(true))
        {
            return Err(EngineError::InvalidParams(format!(
                "token id {bad} is outside the vocabulary"
            )));
        }
        self.admission
            .check_pooling_admissible(prompt_token_ids.len())?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut req = Request::new(
            id,
            prompt_token_ids,
            Arc::new(SamplingParams::default()),
            0,
            self.info.eos_token_ids.clone(),
        );
        req.pooling = true;
        req.token_type_ids = token_type_ids;
        self.submit(req)
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

    /// Stops the engine and waits until its thread has ended and dropped the model (a
    /// model split across processes tells the others to stop then).
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// Marks the engine dead when the engine thread ends, by return or by a panic that escapes
/// the step's own catch: `/health` must not report a dead engine as serving.
struct AliveGuard(Arc<Mutex<EngineStats>>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).alive = false;
    }
}

fn run_loop<E: Executor>(core: &mut EngineCore<E>, rx: mpsc::Receiver<Command>) {
    let _alive = AliveGuard(core.stats.clone());
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_on_the_engine_thread_marks_the_engine_dead() {
        let stats = Arc::new(Mutex::new(EngineStats {
            alive: true,
            ..EngineStats::default()
        }));
        let s = stats.clone();
        let r = std::thread::spawn(move || {
            let _alive = AliveGuard(s);
            panic!("a bug outside the step");
        })
        .join();
        assert!(r.is_err());
        assert!(!stats.lock().unwrap().alive);
    }
}
