//! Shared set-up for the model tests: the real test model, fetched by the project's script.

#![allow(dead_code)]

use ferrite_model::backend::cpu::CpuBackend;
use ferrite_model::backend::Backend;
use ferrite_model::loader::load_cpu_decoder;
use ferrite_model::loader::{LoadFormat, WeightFormat};
use ferrite_model::models::Model;
use ferrite_model::step::PackedStep;
use ferrite_model::step::StepModel;
use std::path::{Path, PathBuf};
use std::process::Command;

pub type CpuModel = Model<CpuBackend>;

/// The repository: where the tests were built, or `FERRITE_REPO_ROOT` (a test binary run on
/// another machine).
pub fn repo_root() -> PathBuf {
    match std::env::var_os("FERRITE_REPO_ROOT") {
        Some(root) => PathBuf::from(root),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."),
    }
}

/// Path of a test model's GGUF (`smollm2`, `gemma3`), fetched (and checksummed) by
/// `scripts/fetch-model.sh`.
pub fn fetch_model(name: &str) -> PathBuf {
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/fetch-model.sh"))
        .arg(name)
        .output()
        .expect("run scripts/fetch-model.sh");
    assert!(
        out.status.success(),
        "fetch-model.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Path of the SmolLM2 GGUF.
pub fn model_path() -> PathBuf {
    fetch_model("smollm2")
}

/// A model on the CPU backend (4096 positions), its KV cache not yet allocated.
pub fn load_path(path: &Path, format: WeightFormat) -> CpuModel {
    load_cpu_decoder(
        path,
        LoadFormat::Auto,
        format,
        None,
        Some(4096),
        &mut |_, _| {},
    )
    .unwrap()
}

pub fn load_model(format: WeightFormat) -> CpuModel {
    load_path(&model_path(), format)
}

/// The largest difference between two sets of rows.
pub fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Block tables of `blocks` blocks for each of `groups` KV groups, the groups' blocks apart.
pub fn fresh_tables(groups: usize, blocks: usize) -> Vec<Vec<u32>> {
    (0..groups)
        .map(|g| {
            (0..blocks as u32)
                .map(|b| (g * blocks) as u32 + b)
                .collect()
        })
        .collect()
}

/// Logits of every position of `tokens`, run as one prefill in a fresh cache (each KV group
/// in blocks of its own).
pub fn all_logits<B: Backend>(model: &mut Model<B>, tokens: &[u32]) -> Vec<Vec<f32>> {
    try_all_logits(model, tokens).unwrap()
}

/// [`all_logits`], or the backend's refusal (an op or a cache it does not serve).
pub fn try_all_logits<B: Backend>(
    model: &mut Model<B>,
    tokens: &[u32],
) -> anyhow::Result<Vec<Vec<f32>>> {
    let bs = 16;
    let blocks = tokens.len().div_ceil(bs);
    let groups = model.layout.groups.len();
    model.allocate_cache(blocks * groups, bs)?;
    model.allocate_state(1)?;
    let mut step = PackedStep::default();
    let tables = fresh_tables(groups, blocks);
    step.push(tokens, 0, &tables, bs);
    step.state.slots.push(0);
    step.logits_indices = (0..tokens.len() as u32).collect();
    step.finish();
    let v = model.config.vocab_size;
    Ok(model
        .forward(&step)?
        .chunks(v)
        .map(|r| r.to_vec())
        .collect())
}

/// Runs A = `a[..40]` in slot 0, checkpointing after 32 tokens into slot 2, then B's last 16
/// tokens from that checkpoint in slot 1 (B's first two blocks are A's); B's logits and
/// the cold ones they should equal.
pub fn prefix_hit<B: Backend>(
    model: &mut Model<B>,
    a: &[u32],
    b: &[u32],
    cold: &[Vec<f32>],
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    use ferrite_model::step::NO_SLOT;
    let bs = 16;
    model.allocate_cache(8, bs).unwrap();
    model.allocate_state(3).unwrap();
    let mut first = PackedStep::default();
    first.push(&a[..40], 0, &[vec![0, 1, 2]], bs);
    first.state.slots = vec![0];
    first.state.restores = vec![NO_SLOT];
    first.state.saves = vec![[32, 2]];
    first.logits_indices = vec![39];
    first.finish();
    model.forward(&first).unwrap();
    let mut hit = PackedStep::default();
    hit.push(&b[32..], 32, &[vec![0, 1, 3]], bs);
    hit.state.slots = vec![1];
    hit.state.restores = vec![2];
    hit.state.saves = vec![[0, NO_SLOT]];
    hit.logits_indices = (0..16).collect();
    hit.finish();
    let v = model.config.vocab_size;
    let got = model
        .forward(&hit)
        .unwrap()
        .chunks(v)
        .map(|r| r.to_vec())
        .collect();
    (got, cold[32..].to_vec())
}

/// The target's and the head's logits at every position, the sequence run in chunks ending at
/// `ends`: after
/// each target step, the head over the same rows with each token moved one ahead (the last
/// row's next token is the sequence's first, as the oracle has it).
pub fn teacher_forced<B: Backend>(
    model: &mut Model<B>,
    tokens: &[u32],
    ends: &[usize],
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let (bs, n) = (16, tokens.len());
    let blocks = n.div_ceil(bs);
    let groups = model.layout.groups.len();
    model.allocate_cache(blocks * groups, bs).unwrap();
    model.allocate_state(1).unwrap();
    let tables = fresh_tables(groups, blocks);
    let v = model.config.vocab_size;
    let step = |ids: &[u32], start: usize| {
        let mut s = PackedStep::default();
        s.push(ids, start, &tables, bs);
        s.state.slots.push(0);
        s.logits_indices = (0..ids.len() as u32).collect();
        s.hidden.keep = true;
        s.finish();
        s
    };
    let rows = |l: &[f32]| l.chunks(v).map(|r| r.to_vec()).collect::<Vec<_>>();
    let (mut target, mut head) = (Vec::new(), Vec::new());
    let starts = std::iter::once(0).chain(ends.iter().copied());
    for r in starts.zip(ends).map(|(a, &b)| a..b) {
        target.extend(rows(
            model.forward(&step(&tokens[r.clone()], r.start)).unwrap(),
        ));
        let next: Vec<u32> = r.clone().map(|i| tokens[(i + 1) % n]).collect();
        head.extend(rows(
            model.forward_mtp(&step(&next, r.start), false).unwrap(),
        ));
    }
    (target, head)
}

/// A verify step with recurrent state: `tokens[..20]` prefilled in slot 0, then the last
/// known token with three drafts (`tokens[21]`, a wrong one, `tokens[23]`), the state after
/// each accepted-draft count written into slots 1-3; one draft held, so the next step feeds
/// `tokens[22..]` from slot 2 (the state after the known token and that draft). Its logits,
/// and the cold ones they should equal.
pub fn draft_rollback<B: Backend>(
    model: &mut Model<B>,
    tokens: &[u32],
    cold: &[Vec<f32>],
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    use ferrite_model::step::NO_SLOT;
    let (bs, n, v) = (16, 20, model.config.vocab_size);
    let groups = model.layout.groups.len();
    let blocks = tokens.len().div_ceil(bs);
    model.allocate_cache(blocks * groups, bs).unwrap();
    model.allocate_state(4).unwrap();
    let tables = fresh_tables(groups, blocks);
    let step = |ids: &[u32], start: usize, restore: u32, drafts: [u32; 2]| {
        let mut s = PackedStep::default();
        s.push(ids, start, &tables, bs);
        s.state.slots = vec![0];
        s.state.restores = vec![restore];
        s.state.saves = vec![[0, NO_SLOT]];
        s.state.drafts = vec![drafts];
        s.logits_indices = (0..ids.len() as u32).collect();
        s.finish();
        s
    };
    model
        .forward(&step(&tokens[..n], 0, NO_SLOT, [0, NO_SLOT]))
        .unwrap();
    let wrong = (tokens[n + 2] + 1) % v as u32;
    let verify = [tokens[n], tokens[n + 1], wrong, tokens[n + 3]];
    model.forward(&step(&verify, n, NO_SLOT, [1, 1])).unwrap();
    let next = step(&tokens[n + 2..], n + 2, 2, [0, NO_SLOT]);
    let got = model.forward(&next).unwrap();
    let got = got.chunks(v).map(|r| r.to_vec()).collect();
    (got, cold[n + 2..].to_vec())
}

/// Logits of every position of `tokens` fed in chunks of `chunk` (1: token by token), with
/// another request (the tokens reversed) sharing each step in state slot 1, ours in slot 0:
/// its rows and state must not touch ours.
pub fn chunked_logits<B: Backend>(
    model: &mut Model<B>,
    tokens: &[u32],
    chunk: usize,
) -> Vec<Vec<f32>> {
    let other: Vec<u32> = tokens.iter().rev().copied().collect();
    let bs = 16;
    let per = tokens.len().div_ceil(bs) as u32;
    model.allocate_cache(2 * per as usize, bs).unwrap();
    model.allocate_state(2).unwrap();
    let tables = [
        vec![(0..per).collect::<Vec<u32>>()],
        vec![(per..2 * per).collect()],
    ];
    let mut got = Vec::new();
    for start in (0..tokens.len()).step_by(chunk) {
        let end = (start + chunk).min(tokens.len());
        let mut step = PackedStep::default();
        step.push(&other[start..end], start, &tables[1], bs);
        step.push(&tokens[start..end], start, &tables[0], bs);
        step.state.slots = vec![1, 0];
        let first = (end - start) as u32;
        step.logits_indices = (first..2 * first).collect();
        step.finish();
        let v = model.config.vocab_size;
        got.extend(model.forward(&step).unwrap().chunks(v).map(|r| r.to_vec()));
    }
    got
}

pub fn fixture() -> serde_json::Value {
    fixture_of("smollm2")
}

/// (top-1 agreement, mean |logprob difference| of the oracle's top token, positions) of
/// `model` over the fixture's teacher-forced sequences.
pub fn oracle_agreement<B: Backend>(
    model: &mut Model<B>,
    fx: &serde_json::Value,
) -> (f64, f64, usize) {
    use ferrite_model::sampler::{argmax, log_sum_exp};
    let (mut agree, mut diff, mut n) = (0usize, 0f64, 0usize);
    for rec in fx["teacher_forced"].as_array().unwrap() {
        let tokens = ids(&rec["token_ids"]);
        let top1 = ids(&rec["top1"]);
        let top1_lp: Vec<f64> = rec["top1_logprob"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        for (i, row) in all_logits(model, &tokens).iter().enumerate() {
            let lse = log_sum_exp(row);
            agree += (argmax(row) == top1[i]) as usize;
            diff += ((row[top1[i] as usize] - lse) as f64 - top1_lp[i]).abs();
            n += 1;
        }
    }
    (agree as f64 / n as f64, diff / n as f64, n)
}

/// `tests/oracle/{model}_fixture.json`, written by `tests/oracle/make_fixture.py`.
pub fn fixture_of(model: &str) -> serde_json::Value {
    let p = repo_root().join(format!("tests/oracle/{model}_fixture.json"));
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// The token ids, and the oracle's logits: `logits` (f32) or `logits_f16_kv`.
pub fn tiny_oracle(family: &str, key: &str) -> (Vec<u32>, Vec<Vec<f32>>) {
    let p = repo_root().join(format!("tests/oracle/tiny/{family}/oracle.json"));
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let logits = j[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect();
    (ids(&j["token_ids"]), logits)
}

/// A number of the tiny oracle's (0 where it has none).
pub fn tiny_oracle_value(family: &str, key: &str) -> f64 {
    let p = repo_root().join(format!("tests/oracle/tiny/{family}/oracle.json"));
    let j: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    j[key].as_f64().unwrap_or(0.0)
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

use ferrite_core::engine::{EngineError, EngineHandle, RequestStream};
use ferrite_core::output::RequestOutput;
use ferrite_model::loader::{load, EngineArgs};
use ferrite_model::tokenizer::ModelTokenizer;
use std::sync::Arc;

/// A running engine on the test model with a small KV pool.
pub fn engine(
    kv_blocks: usize,
    max_num_batched_tokens: usize,
) -> (EngineHandle, Arc<ModelTokenizer>) {
    engine_with_len(kv_blocks, max_num_batched_tokens, 1024)
}

pub fn engine_with_len(
    kv_blocks: usize,
    max_num_batched_tokens: usize,
    max_model_len: usize,
) -> (EngineHandle, Arc<ModelTokenizer>) {
    engine_opts(kv_blocks, max_num_batched_tokens, max_model_len, true)
}

pub fn engine_opts(
    kv_blocks: usize,
    max_num_batched_tokens: usize,
    max_model_len: usize,
    prefix_caching: bool,
) -> (EngineHandle, Arc<ModelTokenizer>) {
    let mut args = EngineArgs::new(model_path());
    if !prefix_caching {
        args.prefix_caching = None;
    }
    args.max_model_len = Some(max_model_len);
    args.max_num_batched_tokens = max_num_batched_tokens;
    args.kv_cache_memory = Some((kv_blocks * 16 * 2 * 30 * 192 * 4) as u64);
    engine_with(args)
}

/// A running engine (seed 0) with `args`.
pub fn engine_with(mut args: EngineArgs) -> (EngineHandle, Arc<ModelTokenizer>) {
    args.seed = Some(0);
    let loaded = load(&args, |_, _| {}).unwrap();
    let tok = Arc::new(loaded.tokenizer);
    let handle = EngineHandle::spawn(
        loaded.scheduler,
        loaded.runner,
        Arc::new(tok.tokenizer.clone()),
        tok.eos_token_ids.clone(),
    );
    (handle, tok)
}

/// The engine's stats once it is idle with every block free (they are published at the end
/// of the step that delivered the last output, just after it); panics after 2 s.
pub fn idle_stats(
    engine: &ferrite_core::engine::EngineHandle,
) -> ferrite_core::engine::EngineStats {
    for _ in 0..200 {
        let st = engine.stats();
        if st.num_running + st.num_waiting == 0 && st.kv_usage == 0.0 {
            return st;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!(
        "engine not idle with every block free: {:?}",
        engine.stats()
    );
}

/// Reads a stream to its end: all outputs, concatenated.
pub fn collect(mut s: RequestStream) -> Result<Vec<RequestOutput>, EngineError> {
    let mut outs = Vec::new();
    while let Some(o) = s.blocking_next() {
        let o = o?;
        let done = o.finish_reason.is_some();
        outs.push(o);
        if done {
            break;
        }
    }
    Ok(outs)
}

pub fn tokens_of(outs: &[RequestOutput]) -> Vec<u32> {
    outs.iter().flat_map(|o| o.token_ids.clone()).collect()
}

pub fn logprobs_of(outs: &[RequestOutput]) -> Vec<ferrite_core::output::TokenLogprob> {
    outs.iter().flat_map(|o| o.logprobs.clone()).collect()
}

pub fn text_of(outs: &[RequestOutput]) -> String {
    outs.iter().map(|o| o.text.as_str()).collect()
}

pub const PROMPTS: [&str; 8] = [
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
    "def quicksort(xs):\n    ",
    "<|im_start|>user\nWhat is 17 times 23? Explain step by step.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who",
    "Q: What is the boiling point of water at sea level?\nA:",
    "List of European capitals: Paris, Berlin, Madrid,",
    "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a prime number larger than 100.<|im_end|>\n<|im_start|>assistant\n",
];

/// Greedy tokens (24 each) of four requests starting 0, 5, 10 and 15 tokens into `prompt`,
/// all at once (their chunks share steps with the others' decodes).
pub fn greedy_staggered(args: EngineArgs, prompt: &[u32]) -> Vec<Vec<u32>> {
    let (engine, _) = engine_with(args);
    let params = ferrite_core::sampling::SamplingParams {
        temperature: 0.0,
        max_tokens: Some(24),
        ignore_eos: true,
        ..Default::default()
    };
    let streams: Vec<_> = (0..4)
        .map(|i| {
            engine
                .add_request(prompt[i * 5..].to_vec(), params.clone())
                .unwrap()
        })
        .collect();
    let out = streams
        .into_iter()
        .map(|s| tokens_of(&collect(s).unwrap()))
        .collect();
    engine.shutdown();
    out
}

/// Runs this test binary's ignored test `entry` as `ranks` processes under `mpirun` with
/// `env` set; the entry's leader writes `{"logits", "tokens"}` to `FERRITE_PARALLEL_OUT`,
/// returned here. Panics, naming `what`, if any rank fails.
pub fn mpirun_split(
    what: &str,
    ranks: usize,
    entry: &str,
    env: &[(&str, String)],
) -> (Vec<Vec<f32>>, Vec<Vec<u32>>) {
    let out = std::env::temp_dir().join(format!(
        "ferrite-{entry}-{}-{}.json",
        what.replace('/', "_"),
        std::process::id()
    ));
    let status = Command::new("mpirun")
        .args([
            "-n",
            &ranks.to_string(),
            "--oversubscribe",
            "--bind-to",
            "none",
        ])
        .arg("--allow-run-as-root")
        .arg(std::env::current_exe().unwrap())
        // The ranks' libtest lines are noise; their panics go to stderr.
        .args([
            "--ignored",
            "--exact",
            entry,
            "--test-threads",
            "1",
            "--nocapture",
        ])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env("FERRITE_PARALLEL_OUT", &out)
        .stdout(std::process::Stdio::null())
        .status()
        .expect("mpirun (Open MPI)");
    assert!(status.success(), "{what}: {status}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    std::fs::remove_file(&out).ok();
    let logits = v["logits"].as_array().unwrap().iter().map(|r| {
        let r = r.as_array().unwrap().iter();
        r.map(|x| x.as_f64().unwrap() as f32).collect()
    });
    let tokens = v["tokens"].as_array().unwrap().iter().map(ids);
    (logits.collect(), tokens.collect())
}
