#!/usr/bin/env bash
# The agent `mini` split on the CPU through a small hybrid (gated delta-net + attention,
# scripts/configs/small-hybrid.json) and a small mixture of experts (small-moe.json), random
# int8 weights (`--load-format dummy`) with SmolLM2's tokenizer and chat template, beside the
# dense SmolLM2-135M on the same run. Writes docs/benchmarks/cpu-agent-mini-families.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p ferrite
cargo build --release -q -p ferrite-model --example hf_folder
smol=$(scripts/fetch-model.sh smollm2)
threads=${THREADS:-2}
levels=${LEVELS:-1,2,4}
res=docs/benchmarks/cpu-agent-mini-families
mkdir -p "$res"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
port=18090
ferrite=./target/release/ferrite

run() {
  local label=$1 model=$2; shift 2
  $ferrite serve "$model" --port $port --threads "$threads" --max-model-len 4096 \
    --kv-cache-memory 800000000 --log-level warn "$@" > "$res/$label.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1200); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
  $ferrite bench serve --base-url "http://127.0.0.1:$port/v1" --tokenizer "$smol" \
    --dataset agent --preset mini --ignore-eos --concurrency "$levels" --seed 0 --fresh-prompts \
    --warmup 1 --label "$label" --out "$res/$label.json" 2> >(grep -v '^\s*$' >&2)
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

for shape in small-hybrid small-moe; do
  target/release/examples/hf_folder "$smol" "scripts/configs/$shape.json" "$work/$shape" >/dev/null
  run "$shape" "$work/$shape" --load-format dummy
done
run smollm2-135m "$smol"

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
    "(`--load-format dummy`) of `scripts/configs/small-hybrid.json` (Qwen3.5-style: 18 gated",
    "delta-net + 6 gated attention layers, hidden 1024, ~0.3B weights) and `small-moe.json`",
    "(Qwen3-MoE-style: 16 layers, 32 experts of 384, 4 per token, ~0.5B weights, ~0.1B active),",
    "with SmolLM2's tokenizer and chat template; SmolLM2-135M (Q4_1 GGUF) in the same run for",
    "reference. Workload: `ferrite bench serve --dataset agent --preset mini --ignore-eos",
    "--fresh-prompts` (32 prompts, ~1K input, 32 output tokens). Prefix caching is on for the",
    "dense and MoE models and off for the hybrid (not yet restored for recurrent state).",
    "",
    "| model | C | completed | mean TTFT ms | mean ITL ms | p99 ITL ms | output tok/s |",
    "|---|---:|---:|---:|---:|---:|---:|",
]
out += [f"| {a} | {c} | {d}/{n} | {t:.0f} | {i:.1f} | {p:.1f} | {o:.1f} |" for a, c, d, n, t, i, p, o in rows]
open(f"{res}.md", "w").write("\n".join(out) + "\n")
print("\n".join(out))
PY
