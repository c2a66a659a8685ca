#!/usr/bin/env bash
# The agent `mini` split on the CPU through a small hybrid (gated delta-net + attention,
# scripts/configs/small-hybrid.json) and a small mixture of experts (small-moe.json), random
# int8 weights (`--load-format dummy`) with SmolLM2's tokenizer and chat template, beside the
# dense SmolLM2-135M on the same run; then the hybrid with prefix caching on and off on an
# agent session replayed turn by turn (everything shared) and on random prompts (nothing
# shared). Writes docs/benchmarks/cpu-agent-mini-families.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p ferrite
cargo build --release -q -p ferrite-model --example hf_folder
smol=$(scripts/fetch-model.sh smollm2)
threads=${THREADS:-2}
levels=${LEVELS:-1,4}
prompts=${PROMPTS:-12}
res=docs/benchmarks/cpu-agent-mini-families
mkdir -p "$res"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
port=18090
ferrite=./target/release/ferrite

# `serve LABEL MODEL [flags]` starts a server; `bench LABEL ARGS` runs one workload on it.
serve() {
  local label=$1 model=$2; shift 2
  $ferrite serve "$model" --port $port --threads "$threads" --max-model-len 4096 \
    --kv-cache-memory 800000000 --max-num-seqs 16 "$@" > "$res/$label.log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
}
bench() {
  local label=$1; shift
  $ferrite bench serve --base-url "http://127.0.0.1:$port/v1" --tokenizer "$smol" --ignore-eos \
    --seed 0 --label "$label" --out "$res/$label.json" --charts-dir "$work/charts" "$@" \
    2> >(grep -v '^\s*$' >&2)
}
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; }
agent=(--dataset agent --preset mini --num-prompts "$prompts" --concurrency "$levels" --fresh-prompts --warmup 1)

if [ -z "${REPORT_ONLY:-}" ]; then
for shape in small-hybrid small-moe; do
  target/release/examples/hf_folder "$smol" "scripts/configs/$shape.json" "$work/$shape" >/dev/null
done
for caching in on off; do
  flags=(--load-format dummy)
  [ $caching = off ] && flags+=(--no-enable-prefix-caching)
  serve "small-hybrid-$caching" "$work/small-hybrid" "${flags[@]}"
  [ $caching = on ] && bench small-hybrid "${agent[@]}"
  bench "hybrid-session-$caching" --dataset session --num-prompts 14 --max-tokens 16 --concurrency 1 --warmup 0
  bench "hybrid-random-$caching" --dataset random --num-prompts "$prompts" --max-tokens 32 \
    --concurrency 4 --warmup 0
  stop
done
serve small-moe "$work/small-moe" --load-format dummy
bench small-moe "${agent[@]}"
stop
serve smollm2-135m "$smol"
bench smollm2-135m "${agent[@]}"
stop
fi

python3 - "$res" "$(lscpu | sed -n 's/^Model name: *//p')" <<'PY'
import json, sys
res, cpu = sys.argv[1], sys.argv[2]
rows = []
for label in ["smollm2-135m", "small-moe", "small-hybrid"]:
    r = json.load(open(f"{res}/{label}.json"))
    for lvl in r["levels"]:
        rows.append((label, lvl["concurrency"], lvl["completed"], lvl["completed"] + lvl["failed"],
                     lvl["mean_ttft_s"] * 1e3, lvl["mean_itl_s"] * 1e3, lvl["p99_itl_s"] * 1e3,
                     lvl["output_throughput"]))
out = [
    "# CPU, agent `mini` split through a hybrid and a mixture of experts",
    "",
    f"`scripts/bench-cpu-families.sh` on {cpu}, 2 threads per server. Random int8 weights",
    "(`--load-format dummy`) of `scripts/configs/small-hybrid.json` (Qwen3.5-style: 9 gated",
    "delta-net + 3 gated attention layers, hidden 1024) and `small-moe.json` (Qwen3-MoE-style:",
    "12 layers, 32 experts of 384, 4 per token), with SmolLM2's tokenizer and chat template;",
    "SmolLM2-135M (Q4_1 GGUF) in the same run for reference; each server's start-up line (its",
    "weights and memory plan) is in its log beside this file. Workload: `ferrite bench serve",
    "--dataset agent --preset mini --num-prompts 12 --ignore-eos --fresh-prompts` (~1K input,",
    "32 output tokens). Two flags, both for memory: `--kv-cache-memory 800000000` gives every",
    "model the same KV pool (the default is a quarter of RAM), and `--max-num-seqs 16` (C <= 4",
    "here) sizes the hybrid's state pool and prefix-cache checkpoints at 16 + 16 slots instead",
    "of 256 + 256; prefix caching is on (the default).",
    "",
    "| model | C | completed | mean TTFT ms | mean ITL ms | p99 ITL ms | output tok/s |",
    "|---|---:|---:|---:|---:|---:|---:|",
]
out += [f"| {a} | {c} | {d}/{n} | {t:.0f} | {i:.1f} | {p:.1f} | {o:.1f} |" for a, c, d, n, t, i, p, o in rows]
def level(name):
    return json.load(open(f"{res}/{name}.json"))["levels"][0]
out += [
    "",
    "## The hybrid's prefix caching on and off",
    "",
    "A hit restores the attention blocks and the recurrent state checkpointed (in place, by the",
    "step that computed it) at the last full prompt block of each chunk. Session: one agent",
    "session replayed turn by turn at C = 1 (each turn the history so far plus a tool call and",
    "its result, 16 output tokens); random: 12 prompts of 512 random tokens at C = 4, nothing",
    "shared.",
    "",
    "| traffic | caching | mean TTFT ms | mean ITL ms | output tok/s | on / off (time) |",
    "|---|---|---:|---:|---:|---:|",
]
for traffic in ["session", "random"]:
    on, off = level(f"hybrid-{traffic}-on"), level(f"hybrid-{traffic}-off")
    for name, l in [("on", on), ("off", off)]:
        ratio = on["duration_s"] / off["duration_s"] if name == "on" else 1.0
        out.append(f"| {traffic} | {name} | {l['mean_ttft_s'] * 1e3:.0f} | {l['mean_itl_s'] * 1e3:.1f} "
                   f"| {l['output_throughput']:.1f} | {ratio:.2f}x |")
open(f"{res}.md", "w").write("\n".join(out) + "\n")
print("\n".join(out))
PY
