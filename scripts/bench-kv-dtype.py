#!/usr/bin/env python3
"""KV cache dtypes side by side in one run: `ferrite serve` on the test model with each
`--kv-cache-dtype` in the same KV memory, the same closed-loop agent `mini` load on each
(`ferrite bench serve --dataset agent --preset mini --ignore-eos`), and the pool each plan line
states. Per level: output tokens/s, mean TTFT, mean and p99 ITL, and each dtype against fp16.

Usage: scripts/bench-kv-dtype.py [--concurrency 1,4,16] [--dtypes fp16,fp8,int8]
                                 [--out docs/benchmarks/cpu-kv-dtype.md]
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import cpu_name, start_server  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
KV_BYTES = 400_000_000


def run_dtype(binary, model, dtype, levels, tmp):
    log = f"ferrite-kv-{dtype}.log"
    proc, url = start_server(binary, model, ["--max-model-len", "4096", "--kv-cache-memory", str(KV_BYTES),
                                             "--kv-cache-dtype", dtype], log)
    try:
        out = os.path.join(tmp, f"kv-{dtype}.json")
        subprocess.run([binary, "bench", "serve", "--base-url", url + "/v1", "--model-name", "m", "--tokenizer",
                        model, "--dataset", "agent", "--preset", "mini", "--ignore-eos", "--fresh-prompts",
                        "--concurrency", levels, "--warmup", "1", "--out", out], check=True, capture_output=True)
        result = json.load(open(out))
    finally:
        proc.terminate()
        proc.wait()
    plan = next(line for line in open(os.path.join(tempfile.gettempdir(), log)) if "KV cache: " in line)
    blocks = int(re.search(r"KV cache: (\d+) blocks", plan).group(1))
    return result["levels"], blocks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--dtypes", default="fp16,fp8,int8")
    p.add_argument("--out", default=os.path.join(ROOT, "docs/benchmarks/cpu-kv-dtype.md"))
    a = p.parse_args()
    binary = os.path.join(ROOT, "target/release/ferrite")
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "ferrite"], cwd=ROOT, check=True)
    model = subprocess.run([os.path.join(ROOT, "scripts/fetch-model.sh"), "smollm2"], check=True,
                           capture_output=True, text=True).stdout.strip()
    dtypes = a.dtypes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {d: run_dtype(binary, model, d, a.concurrency, tmp) for d in dtypes}
    base = runs[dtypes[0]][0]
    rows = ["| KV dtype | pool blocks | C | out tok/s | mean TTFT s | mean ITL ms | p99 ITL ms | "
            f"tok/s vs {dtypes[0]} | mean ITL vs {dtypes[0]} |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for d in dtypes:
        levels, blocks = runs[d]
        for lv, b in zip(levels, base):
            rows.append(f"| {d} | {blocks} | {lv['concurrency']} | {lv['output_throughput']:.1f} | "
                        f"{lv['mean_ttft_s']:.2f} | {lv['mean_itl_s'] * 1e3:.0f} | {lv['p99_itl_s'] * 1e3:.0f} | "
                        f"{lv['output_throughput'] / b['output_throughput']:.2f}x | "
                        f"{lv['mean_itl_s'] / b['mean_itl_s']:.2f}x |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    doc = f"""# CPU: KV cache dtypes on the agent `mini` split

Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by `scripts/bench-kv-dtype.py`, every dtype in one
run, one server after the other, on the same machine.

- Machine: {cpu_name()}, {os.cpu_count()} cores; ferrite {commit}.
- Model: `{os.path.basename(model)}`; `ferrite serve MODEL --max-model-len 4096 --kv-cache-memory {KV_BYTES}
  --kv-cache-dtype D` (the defaults otherwise: int8 weights path, prefix caching on, the step-time target).
- Workload: `ferrite bench serve --dataset agent --preset mini --ignore-eos --fresh-prompts` at C = {a.concurrency}
  (32 prompts per level, ~1K input tokens, 32 output tokens).
- The same KV memory holds 128 / 68 = 1.88x the tokens with 8-bit K/V (head 64: 64 codes and an f32 scale
  against 64 halves). Accuracy of each dtype (teacher-forced against transformers) is in
  `crates/ferrite-model/tests/oracle.rs` (`kv_cache_dtypes_agree_with_transformers`).

{chr(10).join(rows)}
"""
    open(a.out, "w").write(doc)
    print(doc)


if __name__ == "__main__":
    main()
