#!/usr/bin/env bash
# The wheels the device machine lacks, for `bash scripts/gpu/check.sh` there (issue 40).
#
#     bash scripts/gpu/wheels.sh        # here, in the repository root: fills .whl/ (ignored)
#
# The device has Python 3.12 and torch 2.11 with numpy, scipy, pandas, scikit-learn, rich,
# numba, safetensors, pyyaml, packaging, absl-py, attrs, mpmath, wrapt and pytest, but no
# network: what the engine, the tests and the check import beyond those travels as wheels
# (`carry: [".whl"]`). One version of each, --no-deps, CPython 3.12 manylinux x86-64; the
# versions are this checkout's .venv's where it has them (else the fallbacks below).
# mlflow stays behind: the check runs with tracker=none.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PY:-.venv/bin/python}
DEST=.whl
# name==fallback version: the engine's, Hydra's and the imaging models' needs, and those of
# their own requirements the device lacks (dm-tree: dp-accounting's)
WANT=(
  hydra-core==1.3.8
  omegaconf==2.3.1
  antlr4-python3-runtime==4.9.3
  monai==1.6.1
  nibabel==5.4.2
  dp-accounting==0.6.0
  dm-tree==0.1.10
)
# the tree that travels may hold 64 MiB (the project's files and .whl together)
LIMIT=$((64 * 1024 * 1024))

version() {  # the .venv's version of $1, else $2
  "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" \
    2>/dev/null || echo "$2"
}

quiet() {  # pip's output less the notes on this machine's local index folders
  grep -v "is ignored: it is neither a file nor a directory" || true
}

rm -rf "$DEST"
mkdir -p "$DEST"
for spec in "${WANT[@]}"; do
  name=${spec%%==*}
  pin="$name==$(version "$name" "${spec##*==}")"
  if [ "$name" = antlr4-python3-runtime ]; then
    # published as a source archive only: build its (pure-Python) wheel here
    "$PY" -m pip wheel -q --no-deps --no-binary "$name" -w "$DEST" "$pin" 2>&1 | quiet
  else
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --abi cp312 --abi abi3 --abi none \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 --platform any -d "$DEST" "$pin" 2>&1 | quiet
  fi
  echo "  $pin"
done

count=$(find "$DEST" -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#WANT[@]}" ]; then
  echo "expected ${#WANT[@]} wheels in $DEST, found $count:" >&2
  ls "$DEST" >&2
  exit 1
fi
wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
# what travels besides: tracked and untracked-but-not-ignored files (those on disk)
project=$("$PY" - <<'EOF'
import os
import subprocess

out = subprocess.run(
    ["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=False
).stdout
print(sum(os.path.getsize(n) for n in out.split(b"\0") if n and os.path.isfile(n)))
EOF
)
ls -l "$DEST"
awk -v n="$count" -v w="$wheels" -v p="$project" 'BEGIN {
  m = 1048576
  printf "wheels: %d files, %.1f MiB; with the project (%.1f MiB): %.1f MiB of the 64 MiB limit\n",
    n, w / m, p / m, (w + p) / m
}'
if [ $((wheels + project)) -gt "$LIMIT" ]; then
  echo "over the 64 MiB limit of the tree that travels" >&2
  exit 1
fi
