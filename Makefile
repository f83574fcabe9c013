# fedexp — every target sets up .venv first (Python 3.11, torch 2.13.0, the package and its dev tools).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-slow lint bench bench-peers demo-imaging ui-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build on this kind of machine, the CUDA build of 2.13.0 on GPU hosts
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	# the editable package's bytecode, which pip compiles for installed packages only: where
	# PYTHONDONTWRITEBYTECODE is set (many containers), every run compiled fedexp's sources anew
	$(PY) -m compileall -q fedexp hydra_plugins data_prep
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/fedexp run

# two pytest-xdist workers, one torch thread each (tests/conftest.py): the 2-core machine's cores;
# `make test` leaves out the long end-to-end cases (marked slow), `make test-slow` runs them, CI both
test: $(STAMP)
	$(PY) -m pytest -n 2 -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -n 2 -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# MLflow's UI in headless Chromium: fedexp's links open the machine-learning view (screenshot)
ui-check: $(STAMP)
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	$(PY) scripts/check_mlflow_ui.py --plain --out docs/figures/mlflow_ui.png

bench: $(STAMP)
	$(PY) scripts/bench_engine.py

# fedexp against a plain loop, pfl-research and Flower (docs/bench_peers.md): creates .venv-peers
# on first use; Flower runs in a loopback-only network namespace (needs root for unshare -n)
bench-peers: $(STAMP)
	$(PY) scripts/bench_peers.py --setup

# synthetic LUNA16/BraTS studies -> data_prep -> one short federated run per task (all under demo/)
# LUNA16: the paper's class balance (dataset.delta=1: every nodule, as many random non-nodules)
DEMO_RUN := $(VENV)/bin/fedexp run checkpoint_every=0 progress=log tracker.experiment=demo-imaging
demo-imaging: $(STAMP)
	test -d demo/raw/luna16-60 || $(PY) -m data_prep.synthetic luna16 --out demo/raw/luna16-60 --n-studies 60
	test -d demo/raw/brats || $(PY) -m data_prep.synthetic brats --out demo/raw/brats --n-studies 12
	$(PY) -m data_prep.luna16 --root demo/raw/luna16-60 --out demo/prepared/luna16-60 --quiet
	$(PY) -m data_prep.brats --root demo/raw/brats --out demo/prepared/brats --quiet
	$(DEMO_RUN) dataset=luna16 dataset.path=demo/prepared/luna16-60 dataset.delta=1 model=densenet \
		partition=label_imbalance rounds=10 local_steps=10 batch_size=8 lr=0.02 \
		hydra.run.dir=demo/runs/luna16
	$(DEMO_RUN) rounds=3 local_steps=2 batch_size=16 dataset=brats dataset.path=demo/prepared/brats model=unet \
		partition=missing_channel partition.channel=1 'partition.clients=[0,1]' lr=0.1 \
		hydra.run.dir=demo/runs/brats

clean:
	rm -rf outputs multirun mlruns mlartifacts mlflow.db mlflow.db.lock
