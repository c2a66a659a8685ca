//! `ferrite generate`: one prompt through the full engine, text streamed to stdout.

use crate::args::{EngineFlags, SamplingFlags};
use crate::start::start;
use anyhow::{anyhow, bail, Result};
use clap::Args;
use ferrite_model::chat_template::{ChatMessage, ChatTemplate};
use std::io::Write;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    #[command(flatten)]
    pub sampling: SamplingFlags,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long)]
    pub system: Option<String>,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let params = args.sampling.params();
    params.validate().map_err(|e| anyhow!(e))?;
    // One request: a KV pool for one max_model_len request is all it can use (the plan caps
    // the pool at max_num_seqs of them), and touching a quarter of the RAM takes seconds.
    let mut flags = args.engine.clone();
    flags.max_num_seqs = 1;
    let started = start(&flags)?;
    let tok = &started.tokenizer;
    let prompt_ids = if args.chat {
        let src = tok
            .chat_template
            .as_deref()
            .ok_or_else(|| anyhow!("the model has no chat template; drop --chat"))?;
        let text_of = |id: Option<u32>| id.map(|i| tok.token_text(i)).unwrap_or_default();
        let template = ChatTemplate::new(
            src,
            text_of(tok.bos_token_id),
            text_of(tok.eos_token_ids.first().copied()),
        )?;
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(ChatMessage {
                role: "system".into(),
                content: s.clone(),
            });
        }
        messages.push(ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        });
        let text = template.render(&messages, true, minijinja::Value::UNDEFINED)?;
        tok.encode(&text, false)?
    } else {
        tok.encode(&args.prompt, true)?
    };
    let t0 = std::time::Instant::now();
    let mut stream = started.engine.add_request(prompt_ids, params)?;
    let mut out = std::io::stdout().lock();
    let mut first = None;
    let mut n = 0;
    let mut reason = None;
    while let Some(item) = stream.blocking_next() {
        let o = item?;
        first.get_or_insert_with(|| t0.elapsed());
        n = o.num_output_tokens;
        write!(out, "{}", o.text)?;
        out.flush()?;
        if let Some(r) = o.finish_reason {
            reason = Some(r);
            break;
        }
    }
    writeln!(out)?;
    let Some(reason) = reason else {
        bail!("the engine stopped before the request finished");
    };
    let total = t0.elapsed();
    let ttft = first.unwrap_or(total);
    let decode = total.saturating_sub(ttft).as_secs_f64();
    tracing::info!(
        "finish_reason={} tokens={n} ttft={:.3}s decode={:.1} tok/s",
        reason.as_str(),
        ttft.as_secs_f64(),
        if decode > 0.0 {
            (n.saturating_sub(1)) as f64 / decode
        } else {
            0.0
        }
    );
    started.engine.shutdown();
    Ok(())
}
