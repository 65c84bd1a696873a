# Two commands on a fresh machine: `make repro` (set up, run the pipeline) and `make test` (set up, run the tests).
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Offline machines: no telemetry or update checks from DVC and MLflow.
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := 1
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup repro test bench clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || python3 -m venv $(VENV)
	set -o pipefail; $(BIN)/pip install --quiet -c requirements.lock -e '.[test]' 2>&1 \
	  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	$(BIN)/python -c "import coarse2fine, torch, timm, nvidia.dali, tfrecord, dvc, mlflow"
	touch $(STAMP)

repro: setup
	$(BIN)/dvc repro

test: setup
	$(BIN)/python -m pytest

# e.g. make bench BENCH_ARGS="--timm-repo ../pytorch-image-models" (see python bench/run_all.py --help)
bench: setup
	$(BIN)/python bench/run_all.py $(BENCH_ARGS)

clean-venv:
	rm -rf $(VENV)
