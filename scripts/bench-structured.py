#!/usr/bin/env python3
"""Cost of structured output: decode tokens/s of requests constrained by a JSON schema against
the same requests unconstrained, at several concurrencies, in one run of one `ferrite serve`;
and time to first token of a schema's first use against a cached one.

Usage: scripts/bench-structured.py [--concurrency 1,16] [--out docs/benchmarks/cpu-structured.md]
       (the server is started here on the test model; --base-url uses a running one instead)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import cpu_name, start_server  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ITEMS = 40
# Exactly ITEMS one-digit integers: the constrained output has a fixed length, like the
# unconstrained one with ignore_eos, so both runs decode the same number of tokens.
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": ITEMS, "maxItems": ITEMS}


def valid(text):
    """Whether `text` is what SCHEMA allows."""
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return isinstance(v, list) and len(v) == ITEMS and all(isinstance(x, int) and 0 <= x <= 9 for x in v)


def one(url, constrained, i, free_tokens=2 * ITEMS + 1):
    """One streamed chat request: (time to first token, time after it, completion tokens, the
    output kept to the schema: None for a free request)."""
    body = dict(model="m", messages=[{"role": "user", "content": f"List {ITEMS} digits, request {i}."}],
                temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True})
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "digits", "schema": SCHEMA}}
        body["max_tokens"] = 400
    else:
        body["max_tokens"] = free_tokens
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    first, tokens, text = None, 0, []
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
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
    return first - t0, end - first, tokens, valid("".join(text)) if constrained else None


def level(url, constrained, c, n, free_tokens):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        res = list(pool.map(lambda i: one(url, constrained, i, free_tokens), range(n)))
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in res)
    itl = statistics.mean(r[1] / max(r[2] - 1, 1) for r in res)
    return tokens / wall, itl, tokens / n, sum(r[3] is True for r in res)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--base-url")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/ferrite"))
    ap.add_argument("--serve-args", default="", help="extra `ferrite serve` flags (e.g. --device cuda)")
    ap.add_argument("--machine", default=None, help="what to call the machine in the table (default: the CPU)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "cpu-structured.md"))
    a = ap.parse_args()
    proc = None
    url = a.base_url
    if not url:
        proc, url = start_server(a.binary, a.model, ["--max-model-len", "2048", *a.serve_args.split()],
                                 "bench-structured-serve.log")
    try:
        # Warm-up (the schema compiled once); its length sets the free requests' length.
        free_tokens = one(url, True, 0)[2]
        rows = []
        for c in [int(x) for x in a.concurrency.split(",")]:
            free = level(url, False, c, a.requests, free_tokens)
            cons = level(url, True, c, a.requests, free_tokens)
            rows.append((c, free, cons))
            print(c, free, cons, file=sys.stderr)
        # First use of a schema (never seen: compiled in the request) against a cached one.
        firsts, cached = [], []
        for k in range(5):
            s = dict(SCHEMA, description=f"variant {k} {time.time()}")
            body = dict(model="m", messages=[{"role": "user", "content": "digits"}], max_tokens=1,
                        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": s}})
            for out in (firsts, cached):
                t0 = time.perf_counter()
                requests.post(url + "/v1/chat/completions", json=body, timeout=600).raise_for_status()
                out.append(time.perf_counter() - t0)
    finally:
        if proc:
            proc.terminate()
            proc.wait()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    where = ("Constrained rows are masked by llguidance and drawn on the device: the masks are computed "
             "(in parallel, straight into page-locked memory) while the forward pass runs on the GPU, copied "
             "asynchronously, and applied by `mask_rows_f32` before `sample_rows_f32` (a second CUDA graph "
             "after the forward's, in decode steps)." if "cuda" in a.serve_args else
             "Constrained rows are masked by llguidance (the mask computed on another thread during the model "
             "step) and sampled on the host.")
    with open(a.out, "w") as f:
        f.write(f"""# Structured output: what a JSON-schema constraint costs

Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `scripts/bench-structured.py` (commit {commit}),
one `ferrite serve` on `{os.path.basename(a.model)}` ({a.machine or f"CPU: {cpu_name()}, {os.cpu_count()} cores"}); flags: {a.serve_args or "defaults"}.

Workload: {a.requests} chat requests per level, closed loop at concurrency C, streamed,
temperature 0.7. Constrained: `response_format` json_schema = an array of exactly {ITEMS} one-digit
integers (a fixed-length output); free: the same prompts with `max_tokens` set to the
constrained output's length and `ignore_eos`, so both decode the same number of tokens. {where}

| C | free tokens/s | constrained tokens/s | tokens/s ratio | free ITL ms | constrained ITL ms | decode speed ratio = free ITL / constrained ITL (target >= 0.95) | tokens per request (free / constrained) | constrained outputs valid |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|
""")
        for c, free, cons in rows:
            f.write(f"| {c} | {free[0]:.1f} | {cons[0]:.1f} | {cons[0] / free[0]:.2f}x | {free[1] * 1e3:.2f} | {cons[1] * 1e3:.2f} | **{free[1] / cons[1]:.2f}x** | {free[2]:.0f} / {cons[2]:.0f} | {cons[3]} / {a.requests} |\n")
        f.write(f"""
Time of a one-token request with a schema never seen before (compiled in the request) against
the same schema again (compiled grammar reused): median {statistics.median(firsts) * 1e3:.1f} ms vs
{statistics.median(cached) * 1e3:.1f} ms over 5 schemas.
""")
    print(open(a.out).read())


if __name__ == "__main__":
    main()
