#!/usr/bin/env bash
# Stacked runs on the device at the tables' scale (issue 41): the 20 FedAvg runs of
# +experiment=pfednet_tables (delta 1-4 x 5 seeds, 100 rounds) on CUDA, stacked in one process
# against one job a run (Hydra's basic launcher); wall time of each whole sweep.
#
#   run {"command": "bash scripts/gpu/stacked_tables.sh", "carry": [".whl"], "timeout_s": 330}
#
# .whl/ as for scripts/gpu/check.sh (scripts/gpu/wheels.sh). Figures: docs/benchmarks.md.
set -u
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" PYTHONWARNINGS=ignore
work=$(mktemp -d)
for launcher in "hydra/launcher=stacked hydra.launcher.n_jobs=1" "hydra/launcher=basic"; do
  start=$(date +%s.%N)
  # shellcheck disable=SC2086 # (the launcher's words)
  (cd "$work" && timeout 150 python3 -c "from fedexp.cli import entry; entry()" run -m \
    +experiment=pfednet_tables algorithm=fedavg device=cuda tracker=none $launcher \
    > out.txt 2>&1)
  rc=$?
  end=$(date +%s.%N)
  echo "$launcher: exit $rc, $(python3 -c "print(round($end - $start, 1))") s," \
    "$(grep -c '^\[job' "$work/out.txt") jobs done; $(grep 'sweep done' "$work/out.txt")"
  grep '^\[job' "$work/out.txt" | sort -t' ' -k2n | head -4
  rm -rf "$work/multirun" "$work/outputs"
done
