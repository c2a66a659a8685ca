#!/usr/bin/env bash
# The first requests after `ferrite serve` starts against the same requests once the KV pool
# is resident: the server answers /health, five identical 200-token greedy completions run
# one after another, the server idles WAIT seconds (the pool becomes resident), five more.
# Prints each request's seconds and the server's RSS. Run it alternately for two binaries.
# Usage: scripts/bench-first-request.sh BINARY [serve flags...]   (WAIT=40 PORT=8123)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1; shift
port=${PORT:-8123}
model=$(scripts/fetch-model.sh smollm2)
"$bin" serve "$model" --port "$port" --served-model-name m "$@" > /tmp/bench-first-request.log 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf "localhost:$port/health" >/dev/null 2>&1 && break; sleep 0.1; done
req() {
  curl -s "localhost:$port/v1/completions" -H 'content-type: application/json' -o /dev/null -w "%{time_total} " \
    -d '{"model":"m","prompt":"Once upon a time","max_tokens":200,"temperature":0,"ignore_eos":true}'
}
rss() { awk '/VmRSS/ {print int($2 / 1024) " MB"}' "/proc/$pid/status"; }
echo -n "$(basename "$bin") at start: "; for _ in 1 2 3 4 5; do req; done
echo -n "| RSS $(rss) "
sleep "${WAIT:-40}"
echo -n "| RSS $(rss) | after: "; for _ in 1 2 3 4 5; do req; done; echo
