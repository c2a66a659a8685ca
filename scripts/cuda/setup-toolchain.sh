#!/bin/bash
# Builds a CUDA 13.0 toolkit root from PyPI wheels on a GPU-less x86_64 machine, enough for
# `cargo build --features cuda` of candle 0.11.x and for nvcc-compiled kernels of our own.
# Usage: CUDA_TOOLKIT_DIR=$HOME/.cache/ferrite-cuda bash setup-toolchain.sh
#        then: source "$CUDA_TOOLKIT_DIR/env.sh"
# Run `cargo fetch` in the project first (it fetches the optional CUDA crates too): the libcuda stub is generated from cudarc's symbol list.
set -euo pipefail
DIR=${CUDA_TOOLKIT_DIR:-$HOME/.cache/ferrite-cuda}
mkdir -p "$DIR"
python3 -m venv "$DIR/venv"
# Pin every wheel to 13.0.x: the H200 driver is CUDA 13.0 (580). nvidia-cuda-nvcc 13.0.88 otherwise
# pulls nvidia-nvvm 13.5, whose PTX (.version 9.5) ptxas 13.0 and the 580 driver reject.
"$DIR/venv/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
  nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88 \
  nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
N=$(ls -d "$DIR"/venv/lib/python3*/site-packages/nvidia/cu13)
R=$DIR/root
mkdir -p "$R/lib/stubs"
ln -sfn "$N/bin" "$R/bin"; ln -sfn "$N/include" "$R/include"; ln -sfn "$N/nvvm" "$R/nvvm"
# the wheels ship only versioned sonames; the linker's -lcublas etc. need the plain names
for f in "$N"/lib/lib*.so.*; do b=$(basename "$f"); ln -sf "$f" "$R/lib/$b"; ln -sf "$f" "$R/lib/${b%%.so.*}.so"; done
# no wheel ships libcuda.so (it comes with the driver): build a link-time stub, SONAME libcuda.so.1,
# from the driver functions that cudarc binds. At run time the real driver's library is used.
CUDARC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/index.crates.io-*/cudarc-0.19.* | sort -V | tail -1)
grep -ohE 'load::<_F>\("cu[A-Za-z0-9_]+"\)' "$CUDARC"/src/driver/sys/*.rs | sed -E 's/.*\("(.*)"\)/\1/' | sort -u \
  | awk '{print "void " $1 "(void){}"}' > "$R/lib/stubs/cuda_stub.c"
gcc -shared -fPIC -o "$R/lib/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$R/lib/stubs/cuda_stub.c"
# The same for NCCL (`--features nccl`): the GPU host's libnccl.so.2 is used at run time.
grep -ohE 'load::<_F>\("nccl[A-Za-z0-9_]+"\)' "$CUDARC"/src/nccl/sys/mod.rs | sed -E 's/.*\("(.*)"\)/\1/' | sort -u \
  | awk '{print "void " $1 "(void){}"}' > "$R/lib/stubs/nccl_stub.c"
gcc -shared -fPIC -o "$R/lib/stubs/libnccl.so" -Wl,-soname,libnccl.so.2 "$R/lib/stubs/nccl_stub.c"
cat > "$DIR/env.sh" <<ENV
export CUDA_ROOT=$R CUDA_HOME=$R CUDA_PATH=$R
export PATH=$R/bin:\$PATH
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}
export LIBRARY_PATH=$R/lib:$R/lib/stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH}
ENV
"$R/bin/nvcc" --version | tail -2
echo "source $DIR/env.sh"
