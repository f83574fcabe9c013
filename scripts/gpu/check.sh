#!/usr/bin/env bash
# The device check (issue 40): one command on the GPU machine; figures and summary in $OUT.
#
#   bash scripts/gpu/check.sh                  # on the device: installs .whl/ (carry it), runs
#   bash scripts/gpu/check.sh --cpu            # the rehearsal here (small sizes, < 5 min)
#   bash scripts/gpu/check.sh --cpu --smallest # its smallest form (tests/test_gpu_check.py)
#   bash scripts/gpu/check.sh --only bench_cnn,profile --budget 200   # some steps again
#
# .whl/ is made here by `bash scripts/gpu/wheels.sh`. Without $OUT the files go to a temp
# folder, named at the end. Steps and files: scripts/gpu/check.py (its parts, the budgets and
# sizes among them: scripts/gpu/device_check/).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore

cpu=0
for arg in "$@"; do
  if [ "$arg" = --cpu ] || [ "$arg" = --smallest ]; then cpu=1; fi
done

if [ "$cpu" = 1 ]; then
  PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
else
  PY=${PY:-python3}
  # the wheels the device lacks, into a scratch site (the device README's recipe)
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo "[check] installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl; then
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
      echo "[check] the wheels did not install; going on with what is there" >&2
    fi
  else
    echo "[check] no .whl/ here (run scripts/gpu/wheels.sh and carry .whl); going on" >&2
  fi
fi
# fedexp from this tree (not installed on the device)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/gpu/check.py "$@"
