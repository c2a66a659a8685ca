//! Benchmark prompts. `agent` is written here after SiliconBench's agent split: a shared system
//! prompt with tool schemas, then varied multi-turn histories of user asks, assistant tool
//! calls and tool results (file listings, diffs, test logs, shell output), sized in tokens.

use anyhow::{bail, Context, Result};
use ferrite_tokenizer::chat_template::ChatTemplate;
use ferrite_tokenizer::tokenizer::ModelTokenizer;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

#[derive(Clone, Debug)]
pub struct BenchPrompt {
    pub messages: Vec<Value>,
    /// The prompt as the chat template renders it (for the completions endpoint).
    pub text: String,
    pub input_tokens: usize,
    pub max_tokens: usize,
}

/// Counts tokens the way the served model will see them.
pub struct Sizer {
    pub tokenizer: ModelTokenizer,
    template: Option<ChatTemplate>,
}

impl Sizer {
    pub fn new(tokenizer: ModelTokenizer) -> Result<Self> {
        let text = |id: Option<u32>| id.map(|i| tokenizer.token_text(i)).unwrap_or_default();
        let template = tokenizer
            .chat_template
            .as_deref()
            .map(|t| {
                ChatTemplate::new(
                    t,
                    text(tokenizer.bos_token_id),
                    text(tokenizer.eos_token_ids.first().copied()),
                )
            })
            .transpose()?;
        Ok(Self {
            tokenizer,
            template,
        })
    }

    pub fn render(&self, messages: &[Value]) -> Result<String> {
        match &self.template {
            Some(t) => t.render(&messages, true, minijinja::Value::UNDEFINED),
            None => Ok(messages
                .iter()
                .map(|m| {
                    format!(
                        "{}: {}\n",
                        m["role"].as_str().unwrap_or(""),
                        m["content"].as_str().unwrap_or("")
                    )
                })
                .collect()),
        }
    }

    pub fn count(&self, messages: &[Value]) -> Result<usize> {
        Ok(self.tokenizer.encode(&self.render(messages)?, false)?.len())
    }
}

#[derive(Clone, Copy, Debug)]
pub struct AgentShape {
    pub num_prompts: usize,
    pub input_mean: usize,
    pub input_min: usize,
    pub input_max: usize,
    pub output_tokens: usize,
}

impl AgentShape {
    pub fn preset(name: &str) -> Result<Self> {
        Ok(match name {
            "mini" => Self {
                num_prompts: 32,
                input_mean: 1000,
                input_min: 400,
                input_max: 2000,
                output_tokens: 32,
            },
            "full" => Self {
                num_prompts: 100,
                input_mean: 4600,
                input_min: 1500,
                input_max: 12000,
                output_tokens: 70,
            },
            other => bail!("unknown agent preset `{other}` (mini, full)"),
        })
    }
}

const TOOLS: &str = r#"[{"type":"function","function":{"name":"read_file","description":"Read a file of the repository","parameters":{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}}},
{"type":"function","function":{"name":"run_shell","description":"Run a shell command in the repository root and return its output","parameters":{"type":"object","properties":{"command":{"type":"string"},"timeout_s":{"type":"integer"}},"required":["command"]}}},
{"type":"function","function":{"name":"apply_patch","description":"Apply a unified diff to the working tree","parameters":{"type":"object","properties":{"diff":{"type":"string"}},"required":["diff"]}}},
{"type":"function","function":{"name":"list_dir","description":"List a directory","parameters":{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}}}]"#;

const ASKS: &[&str] = &[
    "The tests in {m} fail since the last merge. Find out why and fix it.",
    "Add a --verbose flag to the CLI and make {m} log what it does.",
    "Why is {m} so slow on large inputs? Profile it and propose a fix.",
    "Rename the function `{f}` to something clearer everywhere it is used.",
    "Write unit tests for `{f}` in {m}, including the edge cases.",
    "The CI job reports a lint error in {m}. Clean it up.",
    "Refactor {m}: split `{f}` into smaller functions with one job each.",
];
const MODULES: &[&str] = &[
    "src/scheduler.rs",
    "src/kv_cache.rs",
    "src/server/routes.py",
    "lib/parser.ts",
    "pkg/store/store.go",
    "src/main.c",
    "app/models/user.rb",
];
const FUNCS: &[&str] = &[
    "allocate_slots",
    "parse_header",
    "flush_buffer",
    "handle_request",
    "merge_ranges",
    "compute_checksum",
    "retry_with_backoff",
];
const WORDS: &[&str] = &[
    "buffer", "index", "offset", "request", "handler", "config", "value", "result", "error",
    "token", "block", "cache", "queue", "state", "count", "limit", "timeout", "path", "entry",
    "node",
];

fn pick<'a>(rng: &mut StdRng, xs: &'a [&'a str]) -> &'a str {
    xs.choose(rng).unwrap()
}

fn ident(rng: &mut StdRng) -> String {
    format!("{}_{}", pick(rng, WORDS), pick(rng, WORDS))
}

fn file_listing(rng: &mut StdRng) -> String {
    let n = rng.random_range(5..25);
    (0..n)
        .map(|_| {
            let ext = pick(rng, &["rs", "py", "ts", "go", "md", "toml", "json"]);
            format!(
                "{:>8}  2026-11-{:02} {:02}:{:02}  {}.{ext}\n",
                rng.random_range(120..90_000),
                rng.random_range(1..29),
                rng.random_range(0..24),
                rng.random_range(0..60),
                ident(rng)
            )
        })
        .collect()
}

fn diff(rng: &mut StdRng, path: &str) -> String {
    let mut s = format!("--- a/{path}\n+++ b/{path}\n");
    for _ in 0..rng.random_range(1..4) {
        let line = rng.random_range(10..400);
        s += &format!("@@ -{line},6 +{line},7 @@\n");
        for _ in 0..rng.random_range(3..9) {
            let sign = pick(rng, &[" ", " ", "-", "+"]);
            s += &format!(
                "{sign}    let {} = {}({}, {});\n",
                ident(rng),
                ident(rng),
                ident(rng),
                rng.random_range(0..1000)
            );
        }
    }
    s
}

fn test_log(rng: &mut StdRng) -> String {
    let n = rng.random_range(4..20);
    let mut s = format!("running {n} tests\n");
    let mut failed = 0;
    for _ in 0..n {
        let ok = rng.random_bool(0.8);
        failed += (!ok) as usize;
        s += &format!(
            "test {}::tests::{} ... {}\n",
            ident(rng),
            ident(rng),
            if ok { "ok" } else { "FAILED" }
        );
    }
    if failed > 0 {
        s += &format!("\n---- failures ----\nthread 'main' panicked at src/{}.rs:{}:{}:\nassertion `left == right` failed\n  left: {}\n right: {}\n", ident(rng), rng.random_range(1..500), rng.random_range(1..80), rng.random_range(0..100), rng.random_range(0..100));
    }
    s + &format!(
        "\ntest result: {}. {} passed; {failed} failed; finished in {:.2}s\n",
        if failed > 0 { "FAILED" } else { "ok" },
        n - failed,
        rng.random_range(0.01..30.0)
    )
}

fn shell_output(rng: &mut StdRng) -> String {
    (0..rng.random_range(3..15))
        .map(|_| {
            format!(
                "{}: {} {} ({} ms)\n",
                pick(rng, &["INFO", "WARN", "DEBUG", "ERROR"]),
                ident(rng),
                rng.random_range(0..100_000),
                rng.random_range(1..900)
            )
        })
        .collect()
}

/// One agent turn: the assistant calls a tool and gets its result back.
fn tool_turn(rng: &mut StdRng, module: &str) -> [Value; 2] {
    let (call, result) = match rng.random_range(0..4) {
        0 => (
            json!({"name": "list_dir", "arguments": {"path": "src"}}),
            file_listing(rng),
        ),
        1 => (
            json!({"name": "apply_patch", "arguments": {"diff": "..."}}),
            format!("applied:\n{}", diff(rng, module)),
        ),
        2 => (
            json!({"name": "run_shell", "arguments": {"command": "cargo test"}}),
            test_log(rng),
        ),
        _ => (
            json!({"name": "run_shell", "arguments": {"command": format!("grep -rn {} .", pick(rng, FUNCS))}}),
            shell_output(rng),
        ),
    };
    [
        json!({"role": "assistant", "content": format!("<tool_call>\n{call}\n</tool_call>")}),
        json!({"role": "tool", "content": result}),
    ]
}

/// Input lengths `min + (max - min) * u^k`, `k` chosen so the mean is `mean`. One `u` per
/// stratum of [0, 1) (then shuffled), so even 32 prompts hit the mean closely for any seed.
fn target_lens(rng: &mut StdRng, s: &AgentShape) -> Vec<usize> {
    let (lo, hi, m) = (s.input_min as f64, s.input_max as f64, s.input_mean as f64);
    let k = (hi - lo) / (m - lo) - 1.0;
    let n = s.num_prompts;
    let mut lens: Vec<usize> = (0..n)
        .map(|i| {
            let u = (i as f64 + rng.random::<f64>()) / n as f64;
            (lo + (hi - lo) * u.powf(k)).round() as usize
        })
        .collect();
    lens.shuffle(rng);
    lens
}

/// Cuts `text` so that the whole prompt has at most `budget` tokens (binary search on chars).
fn fit_last(sizer: &Sizer, messages: &mut [Value], budget: usize) -> Result<usize> {
    let last = messages.len() - 1;
    let full: Vec<char> = messages[last]["content"]
        .as_str()
        .unwrap_or("")
        .chars()
        .collect();
    let (mut lo, mut hi) = (0usize, full.len());
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        messages[last]["content"] = Value::String(full[..mid].iter().collect());
        if sizer.count(messages)? <= budget {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    messages[last]["content"] = Value::String(full[..lo].iter().collect());
    sizer.count(messages)
}

fn system_prompt() -> Result<String> {
    let tools: Value = serde_json::from_str(TOOLS)?;
    Ok(format!(
        "You are a coding agent working in a git repository. Use the tools to inspect and change \
         the code; call one tool at a time as <tool_call>{{json}}</tool_call>; keep replies short.\n\
         Tools: {}",
        serde_json::to_string(&tools)?
    ))
}

/// One agent session replayed turn by turn: prompt `k` is prompt `k - 1` plus the assistant's
/// tool call and the tool's result, as an agent re-sends its whole history every turn.
pub fn session(
    sizer: &Sizer,
    turns: usize,
    output_tokens: usize,
    seed: u64,
) -> Result<Vec<BenchPrompt>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let module = pick(&mut rng, MODULES);
    let ask = pick(&mut rng, ASKS)
        .replace("{m}", module)
        .replace("{f}", pick(&mut rng, FUNCS));
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt()?}),
        json!({"role": "user", "content": ask}),
    ];
    let mut out = Vec::with_capacity(turns);
    for _ in 0..turns {
        messages.extend(tool_turn(&mut rng, module));
        let text = sizer.render(&messages)?;
        let input_tokens = sizer.count(&messages)?;
        out.push(BenchPrompt {
            messages: messages.clone(),
            text,
            input_tokens,
            max_tokens: output_tokens,
        });
    }
    Ok(out)
}

pub fn agent(sizer: &Sizer, shape: &AgentShape, seed: u64) -> Result<Vec<BenchPrompt>> {
    if !(shape.input_min < shape.input_mean && shape.input_mean < shape.input_max) {
        bail!("need --input-min < --input-mean < --input-max");
    }
    let system = system_prompt()?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut prompts = Vec::with_capacity(shape.num_prompts);
    for target in target_lens(&mut rng, shape) {
        let module = pick(&mut rng, MODULES);
        let ask = pick(&mut rng, ASKS)
            .replace("{m}", module)
            .replace("{f}", pick(&mut rng, FUNCS));
        let mut messages = vec![
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": ask}),
        ];
        let base = sizer.count(&messages)?;
        if base > target {
            bail!("the system prompt alone has {base} tokens, more than the {target}-token target; raise --input-min");
        }
        let mut n = base;
        while n < target {
            messages.extend(tool_turn(&mut rng, module));
            if rng.random_bool(0.15) {
                messages.push(json!({"role": "user", "content": pick(&mut rng, ASKS).replace("{m}", module).replace("{f}", pick(&mut rng, FUNCS))}));
            }
            n = sizer.count(&messages)?;
        }
        // Trim back to the target: drop whole messages while even an empty last one would
        // not fit, then cut the last one.
        while n > target {
            let last = messages.len() - 1;
            let saved =
                std::mem::replace(&mut messages[last]["content"], Value::String(String::new()));
            if sizer.count(&messages)? > target {
                messages.pop();
            } else {
                messages[last]["content"] = saved;
                n = fit_last(sizer, &mut messages, target)?;
                break;
            }
            n = sizer.count(&messages)?;
        }
        let text = sizer.render(&messages)?;
        prompts.push(BenchPrompt {
            messages,
            text,
            input_tokens: n,
            max_tokens: shape.output_tokens,
        });
    }
    Ok(prompts)
}

/// Fixed input and output lengths: filler words, cut to exactly `input_len` tokens.
pub fn random(
    sizer: &Sizer,
    num_prompts: usize,
    input_len: usize,
    output_len: usize,
    seed: u64,
) -> Result<Vec<BenchPrompt>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..num_prompts)
        .map(|_| {
            let words: String = (0..input_len * 2)
                .map(|_| format!("{} ", pick(&mut rng, WORDS)))
                .collect();
            let mut messages = vec![json!({"role": "user", "content": words})];
            let n = fit_last(sizer, &mut messages, input_len)?;
            Ok(BenchPrompt {
                text: sizer.render(&messages)?,
                messages,
                input_tokens: n,
                max_tokens: output_len,
            })
        })
        .collect()
}

/// The first human turn of each conversation of a ShareGPT-format JSON file.
pub fn sharegpt(
    sizer: &Sizer,
    path: &str,
    num_prompts: usize,
    output_len: usize,
) -> Result<Vec<BenchPrompt>> {
    let data: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?,
    )?;
    let mut out = Vec::new();
    for conv in data {
        let first = conv["conversations"]
            .as_array()
            .and_then(|c| c.iter().find(|t| t["from"] == "human"));
        let Some(text) = first.and_then(|t| t["value"].as_str()) else {
            continue;
        };
        let messages = vec![json!({"role": "user", "content": text})];
        let input_tokens = sizer.count(&messages)?;
        out.push(BenchPrompt {
            text: sizer.render(&messages)?,
            messages,
            input_tokens,
            max_tokens: output_len,
        });
        if out.len() == num_prompts {
            break;
        }
    }
    if out.is_empty() {
        bail!("{path} holds no ShareGPT conversations with a human turn");
    }
    Ok(out)
}
