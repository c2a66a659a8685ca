#!/usr/bin/env bash
# The Arm CPU kernels without an Arm machine: cross-builds ferrite-model's tests for
# aarch64-unknown-linux-gnu and runs them under qemu at three CPU levels -- `max` (dotprod and
# i8mm: the `neon-i8mm` set), `neon-n1` (dotprod only: `neon-dotprod`) and `cortex-a57`
# (neither: `neon`) -- each run asserting which kernel set was picked; the quantized kernels
# against exact references at every level, the NEON activation quantizer against the
# scalar one, and SmolLM2 against transformers (teacher-forced top-1) on `neon-i8mm` and
# `neon-dotprod`, with greedy output identical at concurrency 1 and 8. Then type-checks the
# macOS build of the binary. With --serve, also builds the `ferrite` binary for aarch64 and
# serves a chat completion with it as the README's quick start does (5 more minutes: not in
# CI). qemu proves correctness, not speed.
# Usage: scripts/arm-check.sh [--serve]   (installs the cross toolchain and qemu when missing)
set -euo pipefail
cd "$(dirname "$0")/.."
serve=false
[ "${1:-}" = --serve ] && serve=true
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64-static >/dev/null ||
  ! command -v clang >/dev/null; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc-aarch64-linux-gnu g++-aarch64-linux-gnu \
    libc6-dev-arm64-cross qemu-user-static clang >/dev/null
fi
rustup target add aarch64-unknown-linux-gnu aarch64-apple-darwin >/dev/null
target=aarch64-unknown-linux-gnu
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
scripts/fetch-model.sh smollm2 >/dev/null
# The test binaries, by name.
declare -A bin
while read -r name path; do bin[$name]=$path; done < <(
  cargo test --release --target $target -p ferrite-model --lib --test quant --test oracle --test engine \
    --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"] if m["target"]["kind"] != ["lib"] else "lib", m["executable"])')
# Runs a test binary under qemu with CPU `$1` expecting kernel set `$2`.
run() {
  local cpu=$1 isa=$2; shift 2
  echo "== qemu -cpu $cpu, expecting $isa: $*"
  FERRITE_EXPECT_ISA=$isa qemu-aarch64-static -cpu "$cpu" -L /usr/aarch64-linux-gnu "$@"
}
for level in "max neon-i8mm" "neoverse-n1 neon-dotprod" "cortex-a57 neon"; do
  set -- $level
  run "$1" "$2" "${bin[quant]}" --test-threads 2
  run "$1" "$2" "${bin[lib]}" --test-threads 2 quant::activations
done
for level in "max neon-i8mm" "neoverse-n1 neon-dotprod"; do
  set -- $level
  run "$1" "$2" "${bin[oracle]}" --nocapture --exact default_fast_path_agrees_with_transformers
done
run max neon-i8mm "${bin[engine]}" --nocapture --exact greedy_outputs_identical_at_concurrency_1_and_8
# The README's quick start on Arm Linux: the binary as built there serves a chat completion.
if $serve; then
  cargo build --release --target $target -p ferrite
  # Small sizes and no step-time target: under emulation the start-up's profiling steps of
  # 8K tokens take many minutes.
  qemu-aarch64-static -cpu max -L /usr/aarch64-linux-gnu target/$target/release/ferrite serve \
    models/SmolLM2-135M-Instruct.Q4_1.gguf --port 8019 --max-model-len 1024 \
    --max-num-batched-tokens 256 --max-step-ms 0 > target/arm-serve.log 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 300); do curl -sf localhost:8019/health >/dev/null 2>&1 && break; sleep 1; done
  reply=$(curl -sf localhost:8019/v1/chat/completions -H 'content-type: application/json' \
    -d '{"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}') ||
    { cat target/arm-serve.log; exit 1; }
  echo "== served on aarch64 (qemu -cpu max): $reply"
  grep -q 'kernels: .*neon-i8mm' target/arm-serve.log || { echo "start-up line names no neon-i8mm" >&2; exit 1; }
  python3 -c 'import json, sys; r = json.loads(sys.argv[1]); assert r["choices"][0]["message"]["content"], r' "$reply"
  kill $server; wait $server 2>/dev/null || true
fi
# macOS (Apple Silicon): the default binary type-checks; nothing links without Apple's SDK.
# `ring` (TLS for hub downloads) compiles C for the target even for a check: clang, with
# stand-ins for the three SDK headers it includes (its objects are never linked).
stub=target/darwin-stub
mkdir -p $stub
printf '#define TARGET_OS_MAC 1\n#define TARGET_OS_OSX 1\n#define TARGET_OS_IPHONE 0\n#define TARGET_OS_IOS 0\n#define TARGET_OS_SIMULATOR 0\n' > $stub/TargetConditionals.h
printf '#define assert(x) ((void)0)\n' > $stub/assert.h
printf '#include <stddef.h>\nvoid *memcpy(void *, const void *, size_t);\nvoid *memmove(void *, const void *, size_t);\nvoid *memset(void *, int, size_t);\nint memcmp(const void *, const void *, size_t);\n' > $stub/string.h
CC_aarch64_apple_darwin=clang CFLAGS_aarch64_apple_darwin="-ffreestanding -nostdlibinc -I$PWD/$stub" \
  cargo check --release --target aarch64-apple-darwin -p ferrite
echo "arm-check: ok"
