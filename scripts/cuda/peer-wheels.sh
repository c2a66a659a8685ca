#!/usr/bin/env bash
# Downloads into .whl/ the web packages `transformers serve` needs and the GPU host's image lacks
# (fastapi, uvicorn, pydantic, openai and their own needs), for Python 3.12 on x86-64 Linux.
# scripts/cuda/serve-peer.sh installs them there; name .whl in the device call's carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
for p in fastapi==0.118.0 starlette==0.48.0 uvicorn==0.37.0 pydantic==2.11.9 pydantic-core==2.33.2 \
  openai==1.109.1 annotated-types==0.7.0 typing-inspection==0.4.1 jiter==0.11.0 distro==1.9.0 \
  sniffio==1.3.1; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$p"
done
ls .whl
