//! A panic inside the model step fails that step's requests with an error and leaves the
//! engine serving the next ones, with every KV block returned.

use ferrite_core::engine::{EngineError, EngineHandle, ExecError, Executor};
use ferrite_core::output::{SampledToken, StepOutput};
use ferrite_core::sampling::SamplingParams;
use ferrite_core::scheduler::{SchedulerConfig, SchedulerOutput};
use std::collections::HashMap;
use std::sync::Arc;
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::Tokenizer;

/// Answers token 1 for every sampled row, and panics on a step that holds token 13.
struct Fragile;

impl Executor for Fragile {
    fn execute(&mut self, out: &SchedulerOutput) -> Result<StepOutput, ExecError> {
        if out.requests.iter().any(|r| r.token_ids.contains(&13)) {
            panic!("kernel bug");
        }
        let mut step = StepOutput::default();
        for r in out.requests.iter().filter(|r| r.sample.is_some()) {
            step.sampled.insert(
                r.req_id,
                vec![SampledToken {
                    token_id: 1,
                    logprobs: None,
                }],
            );
        }
        Ok(step)
    }
}

fn tokenizer() -> Arc<Tokenizer> {
    let vocab: HashMap<String, u32> = (0..32).map(|i| (format!("t{i}"), i)).collect();
    let model = WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("t0".into())
        .build()
        .unwrap();
    Arc::new(Tokenizer::new(model))
}

/// 32 blocks of 4 tokens, 8 requests a step.
fn small_pool() -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: 64,
        max_num_seqs: 8,
        max_model_len: 64,
        block_size: 4,
        num_blocks: 32,
        prefix_caching: None,
        kv_groups: vec![None],
        state_slots: 0,
        state_checkpoints: 0,
        draft_state_sets: 0,
        whole_prompts: false,
        step_time: None,
        speculation: None,
    }
}

fn run(engine: &EngineHandle, prompt: Vec<u32>) -> Result<usize, EngineError> {
    let params = SamplingParams {
        max_tokens: Some(4),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut stream = engine.add_request(prompt, params)?;
    let mut tokens = 0;
    while let Some(out) = stream.blocking_next() {
        let out = out?;
        tokens += out.token_ids.len();
        if out.finish_reason.is_some() {
            break;
        }
    }
    Ok(tokens)
}

#[test]
fn a_panicking_step_fails_its_requests_and_the_engine_lives_on() {
    let engine = EngineHandle::spawn(small_pool(), Fragile, tokenizer(), vec![]);
    match run(&engine, vec![2, 13, 5]) {
        Err(EngineError::Step(msg)) => assert!(msg.contains("kernel bug"), "{msg}"),
        other => panic!("expected a step error, got {other:?}"),
    }
    assert_eq!(run(&engine, vec![2, 3, 5]).unwrap(), 4);
    let idle = (0..200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(5));
        let st = engine.stats();
        st.num_running + st.num_waiting == 0 && st.kv_usage == 0.0
    });
    assert!(idle, "blocks not returned: {:?}", engine.stats());
}

/// Sleeps a while in every step.
struct Slow;

impl Executor for Slow {
    fn execute(&mut self, out: &SchedulerOutput) -> Result<StepOutput, ExecError> {
        std::thread::sleep(std::time::Duration::from_millis(600));
        Fragile.execute(out)
    }
}

#[test]
fn a_running_step_shows_since_when_so_a_wedged_engine_is_seen() {
    let engine = EngineHandle::spawn(small_pool(), Slow, tokenizer(), vec![]);
    assert!(engine.stats().step_started.is_none());
    let e = engine.clone();
    let t = std::thread::spawn(move || run(&e, vec![2, 3]));
    let longest = (0..100)
        .filter_map(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            engine.stats().step_started.map(|s| s.elapsed())
        })
        .max()
        .expect("a step was seen running");
    assert!(
        longest >= std::time::Duration::from_millis(300),
        "{longest:?}"
    );
    assert_eq!(t.join().unwrap().unwrap(), 4);
    // The last output goes out just before the step's end is published.
    let ended = (0..200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(5));
        engine.stats().step_started.is_none()
    });
    assert!(ended, "a step still shows as running");
}
