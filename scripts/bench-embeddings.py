#!/usr/bin/env python3
"""Embedding throughput: `ferrite serve` on all-MiniLM-L6-v2 against sentence-transformers on
the same CPU cores, in the same run: texts/s at batch 1 (one text per call, calls one after
another) and at batch 64 (64 texts per call); ferrite also with 64 one-text calls at once (how
a server is used). Every vector is checked against sentence-transformers' (cosine).

Needs torch and sentence-transformers (`pip install torch sentence-transformers`).
Usage: scripts/bench-embeddings.py [--texts 256] [--out docs/benchmarks/cpu-embeddings.md]
"""
import argparse
import math
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import cpu_name, start_server  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WORDS = ("the a of model server token cache batch request embedding vector engine step prefill "
         "memory block kernel thread answer question search document query rank score fast slow "
         "city river mountain market library window garden morning evening letter").split()


def texts(n):
    rng = random.Random(0)
    # Sentence lengths as retrieval traffic has them: mostly short, some paragraphs.
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([6, 12, 24, 48, 96])))
            for _ in range(n)]


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def ferrite_embed(url, batch):
    r = requests.post(url + "/v1/embeddings", json={"input": batch, "encoding_format": "float"})
    r.raise_for_status()
    return [d["embedding"] for d in r.json()["data"]]


def timed(f):
    t0 = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "ferrite"))
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--out")
    a = ap.parse_args()
    model = subprocess.check_output([os.path.join(ROOT, "scripts", "fetch-model.sh"), "minilm"], text=True).strip()
    data = texts(a.texts)
    import torch
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(model, device="cpu")
    st.encode(data[:8])  # warm-up
    rows = []
    ref, t1 = timed(lambda: [st.encode([t])[0] for t in data])
    _, t64 = timed(lambda: st.encode(data, batch_size=64))
    proc, url = start_server(a.binary, model, ["--max-model-len", "256"], "bench-embeddings.log")
    try:
        ferrite_embed(url, data[:8])
        v1, f1 = timed(lambda: [ferrite_embed(url, [t])[0] for t in data])
        v64, f64 = timed(lambda: [v for i in range(0, len(data), 64) for v in ferrite_embed(url, data[i:i + 64])])
        with ThreadPoolExecutor(64) as pool:
            vc, fc = timed(lambda: list(pool.map(lambda t: ferrite_embed(url, [t])[0], data)))
    finally:
        proc.terminate()
        proc.wait()
    worst = min(cosine(x, y) for vs in (v1, v64, vc) for x, y in zip(vs, ref))
    n = len(data)
    tokens = sum(len(st.tokenizer(t)["input_ids"]) for t in data)
    rows.append(("1 (one text per call)", n / t1, n / f1))
    rows.append(("64 (64 texts per call)", n / t64, n / f64))
    rows.append(("64 one-text calls at once", None, n / fc))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [
        "# Embeddings on the CPU: ferrite vs sentence-transformers",
        "",
        f"`scripts/bench-embeddings.py --texts {n}` at {commit}: all-MiniLM-L6-v2 (f32 safetensors, "
        f"scripts/fetch-model.sh minilm), {n} texts of 6-96 words ({tokens} tokens in all, "
        f"{tokens / n:.0f} per text). CPU: {cpu_name()}, {os.cpu_count()} cores; sentence-transformers "
        f"{__import__('sentence_transformers').__version__} on torch {torch.__version__} "
        f"({torch.get_num_threads()} threads) in this process, then `ferrite serve` (defaults) over "
        "HTTP, one after the other on the same cores. Every ferrite vector checked against "
        f"sentence-transformers': worst cosine {worst:.7f}.",
        "",
        "| batch | sentence-transformers texts/s | ferrite texts/s | ratio |",
        "|---|---:|---:|---:|",
    ]
    for name, s, f in rows:
        lines.append(f"| {name} | {'' if s is None else f'{s:.1f}'} | {f:.1f} | "
                     f"{'' if s is None else f'{f / s:.2f}x'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
