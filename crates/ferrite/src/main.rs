//! ferrite: an LLM serving engine in one binary.

mod args;
#[cfg(feature = "cuda")]
mod bench_device;
mod bench_offline;
mod bench_serve;
mod bench_throughput;
mod generate;
mod plan;
mod ranks;
mod serve;
mod start;

use clap::{Parser, Subcommand};
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "ferrite",
    version,
    about = "An LLM serving engine in one binary"
)]
struct Cli {
    /// Log level (error, warn, info, debug, trace).
    #[arg(long, global = true, default_value = "info")]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API.
    Serve(serve::ServeArgs),
    /// Generate a completion for one prompt, streamed to stdout.
    Generate(generate::GenerateArgs),
    /// The memory plan for a model, from its header alone: weights, KV bytes per token, KV
    /// tokens and concurrency for the memory budget.
    Plan(plan::PlanArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Prefill and decode tokens/s straight through the engine (like llama-bench).
    Offline(bench_offline::OfflineArgs),
    /// A burst of random-token requests at once: requests/s and tokens/s (vLLM's throughput
    /// benchmark).
    Throughput(bench_throughput::ThroughputArgs),
    /// Closed-loop streaming load on any OpenAI-compatible server.
    Serve(Box<bench_serve::ServeBenchArgs>),
    /// Charts of several result files, one line per engine.
    Plot(bench_serve::PlotArgs),
    /// CUDA step times against the device's measured matmul rate and bandwidth.
    #[cfg(feature = "cuda")]
    Device(bench_device::DeviceBenchArgs),
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cli.log_level)),
        )
        .with_writer(std::io::stderr)
        // Colours only for a terminal: redirected logs stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = match cli.command {
        Command::Serve(a) => serve::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Bench(BenchCommand::Offline(a)) => bench_offline::run(a),
        Command::Bench(BenchCommand::Throughput(a)) => bench_throughput::run(a),
        Command::Bench(BenchCommand::Serve(a)) => bench_serve::serve(*a),
        Command::Bench(BenchCommand::Plot(a)) => bench_serve::plot(a),
        #[cfg(feature = "cuda")]
        Command::Bench(BenchCommand::Device(a)) => bench_device::run(a),
    };
    ferrite_model::parallel::finish();
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
