#!/usr/bin/env python3
"""Speculative decoding on and off, side by side in one run: two `ferrite serve` on the test
model, one with `--speculative-config` (n-gram by default; `--draft-layers N` makes a draft
model of the test model's first N layers with `cut_gguf`), the same closed-loop load on each.

Splits: `copy` (answers that repeat or edit text of the prompt: JSON rewrites, code edits;
greedy, the model stops by itself or at 160 tokens) and the agent `mini` split
(`ferrite bench serve --dataset agent --preset mini --ignore-eos`). Per level: output tokens/s,
mean ITL, and from the speculative server's /metrics the acceptance rate per draft position.

Usage: scripts/bench-speculative.py [--concurrency 1,4,16] [--rounds 3] [--draft-layers N] [--out docs/benchmarks/cpu-speculative.md]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import cpu_name, start_server  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
DISABLE = 4  # ferrite_core::spec_decode::DEFAULT_DISABLE_BY_BATCH_SIZE


def start(binary, model, extra, log_name):
    return start_server(binary, model, ["--max-model-len", "4096", "--kv-cache-memory", "800000000", *extra],
                        log_name)


def copy_prompts(n, first=0):
    """Requests whose answer copies most of the prompt (deterministic; each `first` its own)."""
    out = []
    for i in range(first, first + n):
        if i % 2 == 0:
            rec = {f"field_{k}": {"id": 1000 * i + k, "name": f"item-{i}-{k}", "tags": ["alpha", "beta", f"t{k}"],
                                  "price": round(3.5 * k + i, 2)} for k in range(4)}
            out.append("Return this JSON exactly as it is, but rename the key \"name\" to \"title\" everywhere:\n"
                       + json.dumps(rec, indent=1))
        else:
            fns = "\n\n".join(f"def step_{k}(values, scale={k + i}):\n    total = 0\n    for v in values:\n"
                              f"        total += v * scale\n    return total / max(len(values), 1)" for k in range(3))
            out.append("Copy this Python code and rename every `values` to `items`; change nothing else:\n\n" + fns)
    return out


def one(url, prompt):
    body = dict(model="m", messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=160,
                stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    first, tokens, text = None, 0, []
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            c = json.loads(line[6:])
            if c.get("choices") and c["choices"][0]["delta"].get("content"):
                text.append(c["choices"][0]["delta"]["content"])
                if first is None:
                    first = time.perf_counter()
            if c.get("usage"):
                tokens = c["usage"]["completion_tokens"]
    end = time.perf_counter()
    return first - t0, end - first, tokens, "".join(text)


def copy_level(url, prompts, c):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        res = list(pool.map(lambda p: one(url, p), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in res)
    itl = statistics.mean(r[1] / max(r[2] - 1, 1) for r in res)
    return tokens / wall, itl, [r[3] for r in res]


def agent_level(binary, model, url, c, n, tmp, seed):
    out = os.path.join(tmp, f"agent-{abs(hash(url))}-{c}.json")
    subprocess.run([binary, "bench", "serve", "--base-url", url + "/v1", "--model-name", "m", "--tokenizer", model,
                    "--dataset", "agent", "--preset", "mini", "--ignore-eos", "--num-prompts", str(n),
                    "--concurrency", str(c), "--seed", str(seed), "--out", out], check=True, capture_output=True)
    level = json.load(open(out))["levels"][0]
    return level["output_throughput"], level["mean_tpot_s"]


def mean_level(results):
    """(output tokens/s, mean ITL) over rounds: the mean of each."""
    return statistics.mean(r[0] for r in results), statistics.mean(r[1] for r in results)


def spec_counters(url):
    text = requests.get(url + "/metrics", timeout=10).text
    drafts, drafted, accepted, per_pos = 0, 0, 0, {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_num_drafts_total"):
            drafts = float(line.split()[-1])
        elif line.startswith("vllm:spec_decode_num_draft_tokens_total"):
            drafted = float(line.split()[-1])
        elif line.startswith("vllm:spec_decode_num_accepted_tokens_total"):
            accepted = float(line.split()[-1])
        elif line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total"):
            pos = int(line.split('position="')[1].split('"')[0])
            per_pos[pos] = float(line.split()[-1])
    return drafts, drafted, accepted, per_pos


def acceptance(before, after):
    drafts = after[0] - before[0]
    drafted = after[1] - before[1]
    if drafted == 0:
        return "no drafts (paused: batch above disable_by_batch_size)"
    rate = (after[2] - before[2]) / drafted
    pos = ", ".join(f"{(after[3].get(p, 0) - before[3].get(p, 0)) / drafts:.2f}" for p in sorted(after[3]))
    return f"{rate:.2f} ({pos})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--copy-prompts", type=int, default=16)
    ap.add_argument("--agent-prompts", type=int, default=16)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/ferrite"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "cpu-speculative.md"))
    ap.add_argument("--spec", default=SPEC, help="the `--speculative-config` of the second server")
    ap.add_argument("--splits", default="copy,agent")
    ap.add_argument("--rounds", type=int, default=3, help="off/on turns per level (the figures are their means)")
    ap.add_argument("--serve-args", default="", help="extra `ferrite serve` flags of both servers (e.g. --device cuda)")
    ap.add_argument("--machine", default=None, help="what to call the machine (default: the CPU)")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="speculate with a draft model: the test model's first N layers (written by cut_gguf)")
    ap.add_argument("--draft", default=None, help="speculate with this draft model file")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens of a draft model")
    a = ap.parse_args()
    draft_note = ""
    if a.draft_layers and not a.draft:
        a.draft = os.path.join(tempfile.gettempdir(), f"ferrite-draft-{a.draft_layers}l.gguf")
        subprocess.run(["cargo", "run", "--release", "-q", "-p", "ferrite-model", "--example", "cut_gguf", "--",
                        a.model, a.draft, str(a.draft_layers)], cwd=ROOT, check=True)
        draft_note = f" (`{os.path.basename(a.draft)}`: the first {a.draft_layers} layers of the same GGUF, by `cut_gguf`)"
    if a.draft:
        a.spec = json.dumps({"method": "draft_model", "model": a.draft, "num_speculative_tokens": a.k})
    method = json.loads(a.spec)["method"].replace("_", " ")
    levels = [int(x) for x in a.concurrency.split(",")]
    rows, identical, turn = [], [], 0
    extra = a.serve_args.split()
    with tempfile.TemporaryDirectory() as tmp:
        off, off_url = start(a.binary, a.model, extra, "bench-spec-off.log")
        on, on_url = start(a.binary, a.model, [*extra, "--speculative-config", a.spec], "bench-spec-on.log")
        try:
            for url in (off_url, on_url):
                one(url, copy_prompts(1)[0])  # warm-up
            for split in a.splits.split(","):
                for c in levels:
                    before = spec_counters(on_url)
                    offs, ons, same = [], [], 0
                    # Off and on take turns, so a noisy neighbour's burst lands on both.
                    for _ in range(a.rounds):
                        # Fresh prompts every turn (the same pair for off and on): no turn
                        # reads the prefix cache another filled.
                        turn += 1
                        if split == "copy":
                            prompts = copy_prompts(a.copy_prompts, turn * a.copy_prompts)
                            offs.append(copy_level(off_url, prompts, c))
                            ons.append(copy_level(on_url, prompts, c))
                            same += sum(x == y for x, y in zip(offs[-1][2], ons[-1][2]))
                        else:
                            offs.append(agent_level(a.binary, a.model, off_url, c, a.agent_prompts, tmp, turn))
                            ons.append(agent_level(a.binary, a.model, on_url, c, a.agent_prompts, tmp, turn))
                    r_off, r_on = mean_level(offs), mean_level(ons)
                    if split == "copy":
                        identical.append(f"{same}/{a.rounds * a.copy_prompts} at C={c}")
                    acc = acceptance(before, spec_counters(on_url))
                    rows.append((split, c, r_off, r_on, acc))
                    print(split, c, r_off, r_on, acc, file=sys.stderr)
        finally:
            for p in (off, on):
                p.terminate()
                p.wait()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    with open(a.out, "w") as f:
        f.write(f"""# Speculative decoding ({method}) on and off

Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `scripts/bench-speculative.py` (commit {commit}),
{a.machine or f"CPU: {cpu_name()}, {os.cpu_count()} cores"}. Two `ferrite serve {os.path.basename(a.model)} --max-model-len 4096
--kv-cache-memory 800000000 {a.serve_args}` in the same run, the second with
`--speculative-config '{a.spec}'`{draft_note} (`disable_by_batch_size` unless it says: the default,
{DISABLE}: no request drafts while more run). Load: closed loop at concurrency C, streamed, one engine at a time,
the two taking turns {a.rounds} times per level (figures: the means over the turns; a shared host's
noise moves single runs by up to 30%).

- `copy`: {a.copy_prompts} chat requests per turn (new ones each turn and level) whose answer repeats the prompt's text with an edit (a JSON
  object with a key renamed, Python functions with a variable renamed); greedy, up to 160 tokens.
- `agent`: `ferrite bench serve --dataset agent --preset mini --ignore-eos --num-prompts {a.agent_prompts} --seed T`, T new each turn and level
  (mean 1,000 input tokens, 32 output tokens).

Acceptance: accepted / drafted tokens over the level, then per draft position the share of
drafts whose token at that position held.

| split | C | output tokens/s off | on | on / off | mean ITL ms off (per output token, after the first) | on | acceptance (per position) |
|---|---:|---:|---:|---:|---:|---:|---|
""")
        for split, c, r_off, r_on, acc in rows:
            f.write(f"| {split} | {c} | {r_off[0]:.1f} | {r_on[0]:.1f} | **{r_on[0] / r_off[0]:.2f}x** | "
                    f"{r_off[1] * 1e3:.1f} | {r_on[1] * 1e3:.1f} | {acc} |\n")
        if identical:
            f.write(f"\nGreedy `copy` answers identical on and off: {', '.join(identical)}.\n")
    print(open(a.out).read())


if __name__ == "__main__":
    main()
