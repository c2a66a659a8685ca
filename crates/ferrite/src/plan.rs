//! `ferrite plan`: the memory plan the server would make, from the checkpoint's header and
//! config alone (no weights read): weights, KV bytes per token per layer group, the KV pool
//! and how many `max_model_len` requests it holds; on the CPU, or on a GPU through wgpu
//! (the adapter opened and named, with its API, driver and limits).

use crate::args::EngineFlags;
use anyhow::{bail, Result};
use clap::Args;
use ferrite_model::loader::{plan_from_header, DeviceKind, HeaderPlan, LoadFormat};
use ferrite_model::memory::{physical_memory_bytes, MemoryPlan};
use ferrite_model::weights::footprint::PlanTarget;
use serde_json::json;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub engine: EngineFlags,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

const GIB: f64 = (1u64 << 30) as f64;

pub fn run(args: PlanArgs) -> Result<()> {
    args.engine.check_dtype()?;
    let engine = args.engine.engine_args();
    if engine.load_format == LoadFormat::Dummy {
        bail!("ferrite plan reads the checkpoint's header: drop --load-format dummy");
    }
    let (target, adapter) = target(&engine)?;
    let HeaderPlan {
        plan,
        config,
        weight_format: format,
    } = plan_from_header(&engine, &target)?;
    // K and V of one token for every KV head of one layer.
    let token_row = 2 * config.num_kv_heads * plan.kv_dtype.head_bytes(config.head_dim);
    let groups: Vec<serde_json::Value> = plan
        .kv_groups
        .iter()
        .map(|w| {
            json!({
                "layers": plan.layers_per_block,
                "sliding_window": w,
                "bytes_per_token": token_row * plan.layers_per_block,
            })
        })
        .collect();
    let kv = json!({
        "dtype": plan.kv_dtype.name(),
        "bytes_per_block": plan.bytes_per_block,
        "num_blocks": plan.num_blocks,
        "kv_tokens": plan.kv_tokens(),
        "kv_bytes": plan.kv_bytes,
        "max_concurrency": plan.max_concurrency(),
        "capped_by_max_num_seqs": plan.capped,
    });
    if args.json {
        let out = json!({
            "model": engine.model.display().to_string(),
            "device": adapter,
            "architecture": config.architecture,
            "num_layers": config.num_layers,
            "weight_format": format,
            "weight_bytes": plan.weight_bytes,
            "activation_bytes_estimate": plan.activation_bytes,
            "device_bytes": plan.device_bytes,
            "gpu_memory_utilization": plan.utilization,
            "budget_bytes": plan.budget_bytes,
            "max_model_len": plan.max_model_len,
            "max_num_seqs": engine.max_num_seqs,
            "block_size": plan.block_size,
            "kv_groups": groups,
            "kv_cache": kv,
            "state_slots": plan.state_slots,
            "state_checkpoints": plan.state_checkpoints,
            "state_draft_slots": plan.state_draft_slots,
            "state_bytes": plan.state_bytes,
            "draft_model": plan.draft.map(|d| json!({
                "weight_bytes": d.weight_bytes,
                "bytes_per_block": d.bytes_per_block,
            })),
            "startup_line": plan.to_string(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    if let Some(adapter) = &adapter {
        println!("device: {adapter}");
    }
    print_text(&plan, &config, &groups, &format, engine.max_num_seqs);
    Ok(())
}

/// The device the plan is for: the CPU's memory, or the wgpu adapter `--device` names
/// (and its description).
fn target(
    engine: &ferrite_model::loader::EngineArgs,
) -> Result<(PlanTarget<'static>, Option<String>)> {
    match engine.device {
        DeviceKind::Cpu => Ok((
            PlanTarget {
                bytes: physical_memory_bytes()?,
                layer_pages_limit: None,
                store: None,
            },
            None,
        )),
        #[cfg(feature = "wgpu")]
        DeviceKind::Wgpu(..) => {
            let (target, adapter) = ferrite_model::backend::wgpu::start::plan_target(engine)?;
            Ok((target, Some(adapter)))
        }
        _ => bail!(
            "ferrite plan sizes the CPU and wgpu backends; on CUDA the server's start-up line \
             states its plan (the activation peak is measured there)"
        ),
    }
}

fn print_text(
    plan: &MemoryPlan,
    config: &ferrite_model::config::ModelConfig,
    groups: &[serde_json::Value],
    format: &str,
    max_num_seqs: usize,
) {
    println!(
        "model: {} ({} layers, {} heads / {} KV heads of {}), max_model_len {}",
        config.architecture,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        plan.max_model_len
    );
    println!(
        "memory: {:.2} GiB budget = {:.2} x {:.2} GiB",
        plan.budget_bytes as f64 / GIB,
        plan.utilization,
        plan.device_bytes as f64 / GIB
    );
    println!(
        "weights: {:.3} GiB ({format}; {} bytes, what loading takes)",
        plan.weight_bytes as f64 / GIB,
        plan.weight_bytes
    );
    println!(
        "activations: {:.3} GiB (estimated for one step; start-up measures it)",
        plan.activation_bytes as f64 / GIB
    );
    if plan.state_slots > 0 {
        println!(
            "recurrent state: {} slots + {} checkpoints + {} draft slots, {:.3} GiB",
            plan.state_slots,
            plan.state_checkpoints,
            plan.state_draft_slots,
            plan.state_bytes as f64 / GIB
        );
    }
    println!(
        "KV bytes per token, per layer group (K and V, {}):",
        plan.kv_dtype.name()
    );
    let mut shown: Vec<(&serde_json::Value, usize)> = Vec::new();
    for g in groups {
        match shown.iter_mut().find(|(s, _)| *s == g) {
            Some((_, n)) => *n += 1,
            None => shown.push((g, 1)),
        }
    }
    for (g, n) in shown {
        let window = match g["sliding_window"].as_u64() {
            Some(w) => format!("sliding window {w}"),
            None => "global".into(),
        };
        println!(
            "  {window}: {n} group(s) of {} layers, {} B each",
            g["layers"], g["bytes_per_token"]
        );
    }
    println!(
        "{:<6} {:>12} {:>10} {:>12} {:>10}  max concurrency at max_model_len {}",
        "KV", "block bytes", "blocks", "KV tokens", "GiB", plan.max_model_len
    );
    println!(
        "{:<6} {:>12} {:>10} {:>12} {:>10.2}  {:.2}x{}",
        plan.kv_dtype.name(),
        plan.bytes_per_block,
        plan.num_blocks,
        plan.kv_tokens(),
        plan.kv_bytes as f64 / GIB,
        plan.max_concurrency(),
        match plan.capped {
            true => format!(" (capped at --max-num-seqs {max_num_seqs})"),
            false => String::new(),
        }
    );
    println!("start-up line: {plan}");
}
