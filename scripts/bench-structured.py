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
import platform
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import requests

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ITEMS = 40
# Exactly ITEMS one-digit integers: the constrained output has a fixed length, like the
# unconstrained one with ignore_eos, so both runs decode the same number of tokens.
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": ITEMS, "maxItems": ITEMS}


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def start_server(model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(ROOT, "target", "bench-structured-serve.log"), "w")
    proc = subprocess.Popen([os.path.join(ROOT, "target/release/ferrite"), "serve", model, "--port", str(port),
                             "--served-model-name", "m", "--max-model-len", "2048",
                             "--kv-cache-memory", str(400 << 20)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not start")


def one(client, constrained, i):
    kw = dict(model="m", messages=[{"role": "user", "content": f"List {ITEMS} digits, request {i}."}],
              temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True})
    if constrained:
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "digits", "schema": SCHEMA}}
        kw["max_tokens"] = 400
    else:
        kw["max_tokens"] = 2 * ITEMS + 1
        kw["extra_body"] = {"ignore_eos": True}
    t0 = time.perf_counter()
    first, tokens = None, 0
    for c in client.chat.completions.create(**kw):
        if c.choices and c.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if c.usage:
            tokens = c.usage.completion_tokens
    end = time.perf_counter()
    return first - t0, end - first, tokens


def level(client, constrained, c, n):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        res = list(pool.map(lambda i: one(client, constrained, i), range(n)))
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in res)
    itl = statistics.mean(r[1] / max(r[2] - 1, 1) for r in res)
    return tokens / wall, itl, tokens / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--base-url")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "cpu-structured.md"))
    a = ap.parse_args()
    proc = None
    url = a.base_url
    if not url:
        proc, url = start_server(a.model)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    try:
        one(client, True, 0)  # warm-up, and the schema compiled once
        rows = []
        for c in [int(x) for x in a.concurrency.split(",")]:
            free = level(client, False, c, a.requests)
            cons = level(client, True, c, a.requests)
            rows.append((c, free, cons))
            print(c, free, cons, file=sys.stderr)
        # First use of a schema (never seen: compiled in the request) against a cached one.
        firsts, cached = [], []
        for k in range(5):
            s = dict(SCHEMA, description=f"variant {k} {time.time()}")
            kw = dict(model="m", messages=[{"role": "user", "content": "digits"}], max_tokens=1,
                      response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": s}})
            t0 = time.perf_counter(); client.chat.completions.create(**kw); firsts.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); client.chat.completions.create(**kw); cached.append(time.perf_counter() - t0)
    finally:
        if proc:
            proc.terminate()
            proc.wait()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    with open(a.out, "w") as f:
        f.write(f"""# Structured output: what a JSON-schema constraint costs

Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `scripts/bench-structured.py` (commit {commit}),
one `ferrite serve` on `{os.path.basename(a.model)}`, CPU: {cpu_name()}, {os.cpu_count()} cores; default flags.

Workload: {a.requests} chat requests per level, closed loop at concurrency C, streamed,
temperature 0.7. Constrained: `response_format` json_schema = an array of exactly {ITEMS} one-digit
integers (a fixed-length output); free: the same prompts with `max_tokens` {2 * ITEMS + 1} and
`ignore_eos`, so both decode about the same number of tokens. Constrained rows are masked by
llguidance (the mask computed on another thread during the model step) and sampled on the host.

| C | free tokens/s | constrained tokens/s | ratio (target >= 0.95) | free ITL ms | constrained ITL ms | tokens per request (free / constrained) |
|---:|---:|---:|---:|---:|---:|---:|
""")
        for c, free, cons in rows:
            f.write(f"| {c} | {free[0]:.1f} | {cons[0]:.1f} | **{cons[0] / free[0]:.2f}x** | {free[1] * 1e3:.2f} | {cons[1] * 1e3:.2f} | {free[2]:.0f} / {cons[2]:.0f} |\n")
        f.write(f"""
Time of a one-token request with a schema never seen before (compiled in the request) against
the same schema again (compiled grammar reused): median {statistics.median(firsts) * 1e3:.1f} ms vs
{statistics.median(cached) * 1e3:.1f} ms over 5 schemas.
""")
    print(open(a.out).read())


if __name__ == "__main__":
    main()
