#!/usr/bin/env python3
"""How far n-gram speculation can go on the `copy` split of scripts/bench-speculative.py.

Greedy output does not depend on speculation, so the answers can be generated once and every
proposer replayed over them exactly: at each step the proposer drafts from the tokens so far,
the drafts that match the answer hold, and the step costs what a step of 1 + draft rows costs
(measured here with `ferrite bench offline --batch B`: a batch of B one-row decodes stands for a
verify step of B rows). Printed per proposer: tokens per verify step, acceptance, and the
decode-time speedup (the off run's steps over the on run's), including an oracle that drafts
exactly the tokens that will hold: the most any draft length policy over these matches can give.

Usage: scripts/spec-draft-sim.py [--prompts 48] [--k 4]
"""
import argparse
import bisect
import os
import re
import subprocess
import sys

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import cpu_name, start_server  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
HORIZON = 64  # ferrite_core::spec_decode::MATCH_HORIZON


def copy_prompts(n):
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_speculative", os.path.join(ROOT, "scripts", "bench-speculative.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.copy_prompts(n, 1000)


def answers(binary, model, n):
    """(prompt ids, answer ids) of n copy prompts, greedy, up to 160 tokens."""
    proc, url = start_server(binary, model, ["--max-model-len", "4096", "--kv-cache-memory", "800000000"],
                             "spec-draft-sim.log")
    out = []
    try:
        for p in copy_prompts(n):
            ids = requests.post(url + "/tokenize", json={"messages": [{"role": "user", "content": p}]}).json()["tokens"]
            r = requests.post(url + "/v1/completions",
                              json={"model": "m", "prompt": ids, "max_tokens": 160, "temperature": 0}).json()
            gen = requests.post(url + "/tokenize", json={"prompt": r["choices"][0]["text"],
                                                          "add_special_tokens": False}).json()["tokens"]
            out.append((ids, gen))
    finally:
        proc.terminate()
        proc.wait()
    return out


def step_costs(binary, model, rows):
    """Seconds of a decode step of each batch size in `rows`."""
    costs = []
    for b in rows:
        run = subprocess.run([binary, "bench", "offline", model, "--batch", str(b), "--prompt-tokens", "256",
                              "--gen-tokens", "32", "--repeats", "2", "--kv-cache-memory", "300000000"],
                             check=True, capture_output=True, text=True)
        tps = float(re.search(r"\| tg32 @ batch \d+ \| ([\d.]+) \|", run.stdout).group(1))
        costs.append(b / tps)
    return costs


def agreement(t, end):
    """Tokens before `end` that agree with the text's last tokens (up to HORIZON)."""
    a = 0
    while a < HORIZON and end - 1 - a >= 0 and t[end - 1 - a] == t[len(t) - 1 - a]:
        a += 1
    return a


def propose(t, k, min_n, max_n, policy):
    for n in range(max_n, min_n - 1, -1):
        if len(t) <= n:
            continue
        ends = [e for e in range(len(t) - 1, n - 1, -1) if t[e - n:e] == t[-n:]]
        if not ends:
            continue
        if policy == "latest":  # the latest occurrence, k tokens (ferrite before this script)
            return t[ends[0]:ends[0] + k]
        # ferrite's: the occurrence agreeing longest, no more than that agreement (the
        # oracle: all that follows it)
        agreed, end = max((agreement(t, e), e) for e in ends)
        return t[end:end + (k if policy == "oracle" else min(k, agreed))]
    return []


def simulate(data, cost, k, min_n, max_n, policy):
    on = off = drafted = held = steps = 0
    for prompt, gen in data:
        t = list(prompt) + gen[:1]  # the first token comes from the prefill, on and off
        i = 1
        while i < len(gen):
            draft = propose(t, k if policy != "oracle" else len(gen), min_n, max_n, policy)[:len(gen) - i - 1]
            h = 0
            while h < len(draft) and draft[h] == gen[i + h]:
                h += 1
            if policy == "oracle":
                draft = draft[:h]
            drafted += len(draft)
            held += h
            steps += 1
            on += cost(1 + len(draft))
            t.extend(gen[i:i + h + 1])
            i += h + 1
        off += cost(1) * (len(gen) - 1)
    tokens = sum(len(g) - 1 for _, g in data)
    return tokens / steps, held / max(drafted, 1), off / on


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--binary", default=os.path.join(ROOT, "target/release/ferrite"))
    a = ap.parse_args()
    rows = [1, 2, 3, 5, 9, 17]
    costs = step_costs(a.binary, a.model, rows)

    def cost(r):
        j = min(bisect.bisect_left(rows, r), len(rows) - 1)
        if rows[j] == r or j == 0:
            return costs[j]
        return costs[j - 1] + (costs[j] - costs[j - 1]) * (r - rows[j - 1]) / (rows[j] - rows[j - 1])

    data = answers(a.binary, a.model, a.prompts)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; {len(data)} copy answers, "
          f"{sum(len(g) for _, g in data)} tokens")
    print("step ms by rows: " + ", ".join(f"{r}: {c * 1e3:.2f}" for r, c in zip(rows, costs)))
    print("| proposer | k | lookup | tokens per step | acceptance | decode time off / on |")
    print("|---|---:|---|---:|---:|---:|")
    for policy in ("latest", "agree", "oracle"):
        for min_n in (2, 1):
            k = a.k if policy != "oracle" else "any"
            per_step, acc, speedup = simulate(data, cost, a.k, min_n, 4, policy)
            print(f"| {policy} | {k} | {min_n}-4 | {per_step:.2f} | {acc:.2f} | {speedup:.2f}x |")


if __name__ == "__main__":
    main()
