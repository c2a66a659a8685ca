#!/usr/bin/env python3
"""Soak test (not in CI): starts `ferrite serve` on the test model and keeps C clients busy for a
while with a mix of chat and completion requests, streamed or not, some abandoned half-way, some
bad; prints requests, errors and the server's RSS over time, and checks that RSS at the end is
within 2% of RSS after the warm-up.

    python3 scripts/soak.py --minutes 60 --concurrency 8 [--out docs/benchmarks/soak.md]
"""
import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def post(url, body, timeout=120, read=True):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if not read:
                r.read(64)  # the first bytes, then hang up
                return r.status
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0  # no answer at all: counted as an error


def worker(url, rng, stop, counts, lock):
    words = "the engine schedules requests in steps and packs their tokens together".split()
    while not stop.is_set():
        kind = rng.random()
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(5, 400)))
        stream = rng.random() < 0.5
        if kind < 0.45:
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": rng.randrange(1, 96),
                    "temperature": rng.choice([0, 0.7, 1.0]), "stream": stream}
            path, read = "/v1/chat/completions", True
        elif kind < 0.8:
            body = {"prompt": text, "max_tokens": rng.randrange(1, 96), "stream": stream,
                    "n": rng.choice([1, 1, 2])}
            path, read = "/v1/completions", True
        elif kind < 0.92:  # abandoned: the client reads a little and leaves
            body = {"prompt": text, "max_tokens": 400, "stream": True, "ignore_eos": True}
            path, read = "/v1/completions", False
        else:  # bad input
            body = {"prompt": text, "max_tokens": -3, "temperature": "hot"}
            path, read = "/v1/completions", True
        status = post(url + path, body, read=read)
        with lock:
            counts["requests"] += 1
            key = "bad (expected 400)" if kind >= 0.92 else "ok"
            if kind >= 0.92:
                counts["errors"] += status != 400
            else:
                counts["errors"] += status != 200
            counts[key] = counts.get(key, 0) + 1
            if status >= 500:
                counts["5xx"] += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup", type=float, default=2, help="minutes before the reference RSS")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--port", type=int, default=8399)
    ap.add_argument("--out")
    a = ap.parse_args()
    binary = os.path.join(ROOT, "target", "release", "ferrite")
    log = open(os.path.join(ROOT, "target", "soak-server.log"), "w")
    proc = subprocess.Popen([binary, "serve", a.model, "--port", str(a.port), "--max-model-len", "2048",
                             "--kv-cache-memory", str(256 << 20)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{a.port}"
    for _ in range(600):
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                break
        except Exception:
            time.sleep(0.2)
    counts = {"requests": 0, "errors": 0, "5xx": 0}
    lock, stop = threading.Lock(), threading.Event()
    threads = [threading.Thread(target=worker, args=(url, random.Random(i), stop, counts, lock), daemon=True)
               for i in range(a.concurrency)]
    start = time.time()
    for t in threads:
        t.start()
    rows, ref = [], None
    while time.time() - start < a.minutes * 60:
        time.sleep(min(60, a.minutes * 60 - (time.time() - start)))
        m = (time.time() - start) / 60
        r = rss_mib(proc.pid)
        if ref is None and m >= a.warmup:
            ref = r
        with lock:
            rows.append((m, counts["requests"], counts["errors"], counts["5xx"], r))
        print(f"{m:6.1f} min  requests {rows[-1][1]:7d}  errors {rows[-1][2]:4d}  5xx {rows[-1][3]:3d}  RSS {r:8.1f} MiB",
              flush=True)
    stop.set()
    for t in threads:
        t.join(timeout=150)
    alive = proc.poll() is None
    end = rss_mib(proc.pid) if alive else 0.0
    proc.terminate()
    proc.wait(timeout=60)
    ref = ref or rows[0][4]
    drift = (end - ref) / ref
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    lines = [f"Soak: {a.minutes:g} min at C={a.concurrency} on {cpu} ({os.cpu_count()} cores), "
             f"`python3 scripts/soak.py --minutes {a.minutes:g} --concurrency {a.concurrency}`", "",
             "| minute | requests | errors | 5xx | RSS MiB |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {m:.1f} | {n} | {e} | {f} | {r:.1f} |" for m, n, e, f, r in rows]
    lines += ["", f"requests {counts['requests']}, errors {counts['errors']} ({counts['5xx']} of them 5xx), "
              f"server alive at the end: {alive}; RSS after warm-up {ref:.1f} MiB, at the end {end:.1f} MiB "
              f"({drift * 100:+.2f}%, target within 2%)"]
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    ok = alive and counts["errors"] == 0 and abs(drift) <= 0.02
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
