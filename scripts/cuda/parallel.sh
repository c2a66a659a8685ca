#!/usr/bin/env bash
# Runs on the GPU host, from the repository root: the CUDA tensor/pipeline-parallel tests
# (crates/ferrite-model/tests/cuda_parallel.rs) with the models scripts/cuda/bundle.sh packed
# (unpacked into /tmp/ferrite by an earlier call) and .device/parallel.tar.xz carried. Every
# rank shares GPU 0 when the host has one. Log: $OUT/parallel.log (or /tmp/ferrite-out).
set -euo pipefail
out=${OUT:-/tmp/ferrite-out}
mkdir -p "$out" /tmp/ferrite
xz -dc .device/parallel.tar.xz | tar -C /tmp/ferrite -xf -
model=$(ls /tmp/ferrite/models/smollm2-*l.gguf 2>/dev/null | head -1)
[ -n "$model" ] || { echo "models not unpacked: see scripts/cuda/bundle.sh" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "no mpirun on this host (Open MPI)" >&2; exit 1; }
mpirun --version | head -1 | tee "$out/mpi.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
root=$PWD
cd /tmp/ferrite
FERRITE_CUDA_TEST_MODEL=$model FERRITE_REPO_ROOT=$root ./bin/cuda-parallel-tests \
  --test-threads 1 --nocapture cuda_splits 2>&1 | tee "$out/parallel.log" \
  | grep -E "^test |test result|tensor-parallel|panicked|error" 
