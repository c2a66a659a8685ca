//! `ferrite bench serve` and `ferrite bench plot`: closed-loop load on any OpenAI-compatible
//! server, reported as a table, a JSON file and charts.

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrite_bench::client::{Endpoint, Target};
use ferrite_bench::dataset::{self, AgentShape, BenchPrompt, Sizer};
use ferrite_bench::report::{charts, table, LevelJson, RunReport};
use ferrite_bench::run::run_level;
use ferrite_model::tokenizer::ModelTokenizer;
use ferrite_model::weights::gguf::GgufFile;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// Base URL of the OpenAI API, e.g. http://127.0.0.1:8000/v1
    #[arg(long, default_value = "http://127.0.0.1:8000/v1")]
    pub base_url: String,
    /// `model` field sent with each request (default: none).
    #[arg(long)]
    pub model_name: Option<String>,
    /// GGUF file whose tokenizer and chat template size the prompts.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// agent, session (one agent session replayed turn by turn), random or sharegpt.
    #[arg(long, default_value = "agent")]
    pub dataset: String,
    /// Agent preset: mini (2 CPU cores) or full.
    #[arg(long, default_value = "mini")]
    pub preset: String,
    #[arg(long)]
    pub num_prompts: Option<usize>,
    #[arg(long)]
    pub input_mean: Option<usize>,
    #[arg(long)]
    pub input_min: Option<usize>,
    #[arg(long)]
    pub input_max: Option<usize>,
    /// Input tokens of each `random` prompt.
    #[arg(long, default_value_t = 512)]
    pub input_len: usize,
    /// Path of a ShareGPT JSON file for `--dataset sharegpt`.
    #[arg(long)]
    pub dataset_path: Option<String>,
    /// Output tokens per request (default: the preset's).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Ask the server to ignore EOS so every request produces max_tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Also ban the model's EOS tokens (`logit_bias` -100), as llama.cpp's server does for
    /// `ignore_eos`: vLLM and ferrite sample EOS and go on, and EOS and the turn markers after
    /// it have no text, so two steps' tokens would arrive as one chunk, one gap. For
    /// comparisons with llama.cpp.
    #[arg(long, requires = "ignore_eos")]
    pub ban_eos: bool,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    pub concurrency: Vec<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Draw new prompts for each concurrency level (seed + level index), so no level reuses
    /// another's prompts: a server's prefix cache then sees only what real traffic shares.
    #[arg(long)]
    pub fresh_prompts: bool,
    /// Requests sent (and not measured) before each level.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// chat or completions.
    #[arg(long, default_value = "chat")]
    pub endpoint: String,
    #[arg(long, env = "OPENAI_API_KEY")]
    pub api_key: Option<String>,
    /// Name of this engine in tables and charts.
    #[arg(long, default_value = "ferrite")]
    pub label: String,
    /// JSON results file.
    #[arg(long, default_value = "bench-results.json")]
    pub out: PathBuf,
    /// Folder for the charts (default: beside the JSON file).
    #[arg(long)]
    pub charts_dir: Option<PathBuf>,
}

/// The dataset's prompts for `seed`, and the dataset's name.
fn prompts(args: &ServeBenchArgs, sizer: &Sizer, seed: u64) -> Result<(Vec<BenchPrompt>, String)> {
    let shaped = args
        .input_mean
        .or(args.input_min)
        .or(args.input_max)
        .is_some();
    if shaped && args.dataset != "agent" {
        bail!(
            "--input-mean, --input-min and --input-max shape the agent dataset; --dataset {} does not take them (random: --input-len)",
            args.dataset
        );
    }
    Ok(match args.dataset.as_str() {
        "agent" => {
            let mut s = AgentShape::preset(&args.preset)?;
            s.num_prompts = args.num_prompts.unwrap_or(s.num_prompts);
            s.input_mean = args.input_mean.unwrap_or(s.input_mean);
            s.input_min = args.input_min.unwrap_or(s.input_min);
            s.input_max = args.input_max.unwrap_or(s.input_max);
            s.output_tokens = args.max_tokens.unwrap_or(s.output_tokens);
            (
                dataset::agent(sizer, &s, seed)?,
                format!("agent-{}", args.preset),
            )
        }
        "session" => (
            dataset::session(
                sizer,
                args.num_prompts.unwrap_or(12),
                args.max_tokens.unwrap_or(32),
                seed,
            )?,
            "agent-session".to_string(),
        ),
        "random" => (
            dataset::random(
                sizer,
                args.num_prompts.unwrap_or(32),
                args.input_len,
                args.max_tokens.unwrap_or(32),
                seed,
            )?,
            "random".to_string(),
        ),
        "sharegpt" => {
            let path = args
                .dataset_path
                .as_deref()
                .context("--dataset sharegpt needs --dataset-path")?;
            (
                dataset::sharegpt(
                    sizer,
                    path,
                    args.num_prompts.unwrap_or(100),
                    args.max_tokens.unwrap_or(128),
                )?,
                "sharegpt".to_string(),
            )
        }
        other => bail!("unknown dataset `{other}` (agent, session, random, sharegpt)"),
    })
}

pub fn serve(args: ServeBenchArgs) -> Result<()> {
    let tok = ModelTokenizer::load(&GgufFile::open(&args.tokenizer)?)?;
    let banned_token_ids = match args.ban_eos {
        true => tok.eos_token_ids.clone(),
        false => Vec::new(),
    };
    let sizer = Sizer::new(tok)?;
    let (prompts0, name) = prompts(&args, &sizer, args.seed)?;
    let prompts = &prompts0;
    let endpoint = match args.endpoint.as_str() {
        "chat" => Endpoint::Chat,
        "completions" => Endpoint::Completions,
        other => bail!("unknown endpoint `{other}` (chat, completions)"),
    };
    let mean_in =
        prompts.iter().map(|p| p.input_tokens).sum::<usize>() as f64 / prompts.len() as f64;
    eprintln!(
        "{} prompts of {name}: input tokens mean {mean_in:.0}, min {}, max {}; {} output tokens",
        prompts.len(),
        prompts.iter().map(|p| p.input_tokens).min().unwrap_or(0),
        prompts.iter().map(|p| p.input_tokens).max().unwrap_or(0),
        prompts[0].max_tokens
    );
    let target = Target {
        // A fresh connection per request: servers that close idle keep-alive connections
        // would otherwise fail requests sent on a stale one.
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()?,
        base_url: args.base_url.clone(),
        model: args.model_name.clone(),
        endpoint,
        ignore_eos: args.ignore_eos,
        banned_token_ids,
        api_key: args.api_key.clone(),
    };
    let rt = tokio::runtime::Runtime::new()?;
    let mut report = RunReport {
        label: args.label.clone(),
        base_url: args.base_url.clone(),
        dataset: name,
        num_prompts: prompts.len(),
        mean_input_tokens: mean_in,
        max_tokens: prompts[0].max_tokens,
        levels: Vec::new(),
    };
    for (i, &c) in args.concurrency.iter().enumerate() {
        let seed = args.seed + if args.fresh_prompts { i as u64 } else { 0 };
        let fresh;
        let level_prompts = if seed == args.seed {
            prompts
        } else {
            fresh = self::prompts(&args, &sizer, seed)?.0;
            &fresh
        };
        let level = rt.block_on(run_level(
            &target,
            level_prompts,
            c.max(1),
            args.warmup,
            seed,
        ));
        for e in &level.errors {
            eprintln!("C={c}: {e}");
        }
        report.levels.push(LevelJson::from(&level));
    }
    println!("{}", table(&report));
    if let Some(parent) = args.out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", args.out.display()))?;
    let dir = args
        .charts_dir
        .clone()
        .unwrap_or_else(|| args.out.parent().map(PathBuf::from).unwrap_or_default());
    charts(std::slice::from_ref(&report), &dir)?;
    eprintln!(
        "wrote {} and charts in {}",
        args.out.display(),
        dir.display()
    );
    Ok(())
}

#[derive(Args, Debug)]
pub struct PlotArgs {
    /// Result files of `ferrite bench serve`, one line per file.
    #[arg(required = true)]
    pub results: Vec<PathBuf>,
    #[arg(long, default_value = ".")]
    pub out_dir: PathBuf,
}

pub fn plot(args: PlotArgs) -> Result<()> {
    let reports: Vec<RunReport> = args
        .results
        .iter()
        .map(|p| {
            Ok(serde_json::from_str(
                &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            )?)
        })
        .collect::<Result<_>>()?;
    charts(&reports, &args.out_dir)?;
    for r in &reports {
        println!("### {}\n\n{}", r.label, table(r));
    }
    Ok(())
}
