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

# `dvc plots show` offline: its page template with vega, vega-lite and vega-embed inlined (.dvc/config names it).
PLOTS_TEMPLATE := .dvc/plots_offline.html
NPM_CI := npm ci --prefix docs --ignore-scripts --omit=optional --no-audit --no-fund

.PHONY: setup plots-if-node repro test test-fast slurm servers deps bench ablation teacher-quality screenshot ui server promote sweep clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || python3 -m venv $(VENV)
	set -o pipefail; $(BIN)/pip install --quiet -c requirements.lock -e '.[test]' 2>&1 \
	  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
	$(BIN)/python -c "import coarse2fine, torch, timm, nvidia.dali, tfrecord, dvc, mlflow"
	touch $(STAMP)

$(PLOTS_TEMPLATE): docs/package-lock.json docs/plots_template.mjs
	$(NPM_CI) --omit=dev
	node docs/plots_template.mjs $@

# For the tests: the plots template where node and npm are installed; elsewhere tests/test_reports.py is skipped,
# saying why (no other test needs them).
plots-if-node:
	@if command -v node >/dev/null && command -v npm >/dev/null; then $(MAKE) --no-print-directory $(PLOTS_TEMPLATE); \
	  else echo "no node and npm here: $(PLOTS_TEMPLATE) not built, tests/test_reports.py is skipped" >&2; fi

repro: setup $(PLOTS_TEMPLATE)
	$(BIN)/dvc repro

# The tests in TEST_WORKERS processes (pytest-xdist; one intra-op thread each, tests/conftest.py), stealing work
# from each other's queues; then the timing-sensitive ones (marked serial) alone. Fails if either part failed.
# PYTEST_ARGS go to both parts (`make test PYTEST_ARGS=--update-durations` refreshes tests/durations.json).
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
test: setup plots-if-node slurm servers
	status=0; $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not serial" $(PYTEST_ARGS) || status=$$?; \
	  $(BIN)/python -m pytest -m serial $(PYTEST_ARGS) || status=$$?; exit $$status

# The fast tier, before every commit: the unit tests, one whole-DAG `dvc repro` on a tiny subset and one user
# mistake through a 2-rank launch (the slow tests marked smoke); no serial ones.
test-fast: setup plots-if-node
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal -m "(not slow or smoke) and not serial"

# tests/test_slurm.py runs the pipeline on a real Slurm started on this machine: Debian's slurm-wlm and munge,
# installed here when missing and we are root (elsewhere, or if apt fails, that test says why it is skipped).
slurm:
	@if [ "$$(id -u)" = 0 ] && ! { test -x /usr/sbin/slurmctld && test -x /usr/sbin/munged; }; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; } \
	  || echo "warning: could not install slurm-wlm and munge: tests/test_slurm.py's sbatch test is skipped" >&2; fi

# tests/test_team.py (and test_tracking.py's server test) start Debian's PostgreSQL (initdb, pg_ctl in a temporary
# folder) and sshd (its own port and keys) themselves: installed here when missing and we are root (elsewhere, or if
# apt fails, those tests say why they skip).
servers:
	@if [ "$$(id -u)" = 0 ] && ! { ls /usr/lib/postgresql/*/bin/initdb && test -x /usr/sbin/sshd; } >/dev/null 2>&1; then \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql openssh-server >/dev/null; } \
	  || echo "warning: could not install postgresql and openssh-server: the team set-up's tests are skipped" >&2; fi

# dvc.yaml's code deps rewritten from the stages' imports, after adding, moving or removing a module
# (tests/test_provenance.py fails while they differ).
deps: setup
	$(BIN)/python scripts/write_code_deps.py

# e.g. make bench BENCH_ARGS="--timm-repo ../pytorch-image-models" (see python bench/run_all.py --help)
bench: setup
	$(BIN)/python bench/run_all.py $(BENCH_ARGS)

# The recipe's halves on real photographs (data.source: photos) as DVC experiments in a project copy: ground truth
# vs token labels, with and without MixToken, coarse-to-fine vs direct at 64 px (python bench/ablation.py --help).
ablation: setup
	$(BIN)/python bench/ablation.py $(ABLATION_ARGS)

# Token labels from teachers of several qualities (teacher.epochs 30 8 4 3) against ground truth, 2 seeds, as DVC
# experiments on the photos; writes bench/results/teacher_quality_<machine>_<date>.md (bench/teacher_quality.py --help).
teacher-quality: setup
	$(BIN)/python bench/teacher_quality.py $(TEACHER_QUALITY_ARGS)

# The README's picture of the MLflow UI (docs/mlflow-runs.png) from ./mlflow.db, which needs two pipeline runs first
# (e.g. make repro, then dvc exp run -S finetune.optimizer.lr_base=3.2e-3). Debian's Chromium, driven by playwright-core.
CHROMIUM := /usr/bin/chromium
EXPERIMENT = $(shell $(BIN)/python -c "import yaml; print(yaml.safe_load(open('params.yaml'))['tracking']['experiment'])")

screenshot: setup $(CHROMIUM) docs/node_modules/.playwright
	CHROMIUM=$(CHROMIUM) MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false node docs/screenshot.mjs "$(EXPERIMENT)" docs/mlflow-runs.png

$(CHROMIUM):
	@test "$$(id -u)" = 0 || { echo "make screenshot needs Chromium: run 'sudo apt-get install -y chromium', then make screenshot again" >&2; exit 1; }
	apt-get update -qq && apt-get install -y -qq chromium

# playwright-core (docs/package.json's devDependencies; no browser download) beside setup's vega packages.
docs/node_modules/.playwright: docs/package-lock.json
	$(NPM_CI) --include=dev
	touch $@

# A small sweep, the tuning workflow: pre-training's learning rate at three values on a fifth of the data, queued
# as DVC experiments, run SWEEP_JOBS at a time, then listed with the swept params and both evaluations' top-1. Each
# reruns only the stages its change reaches (the rest come from DVC's cache) and is also a pipeline run in MLflow
# named after its experiment. Another grid, e.g.:
#   make sweep SWEEP="-S data.subset=0.2 -S 'finetune.optimizer.lr_base=8e-4,3.2e-3'" SWEEP_COLUMNS='finetune.optimizer.lr_base'
SWEEP ?= -S data.subset=0.2 -S 'pretrain.optimizer.lr_base=8e-3,1.6e-2,3.2e-2'
SWEEP_COLUMNS ?= data.subset|pretrain.optimizer.lr_base
# 1: the first point makes the records, teacher and token labels of the new subset, the others restore them.
SWEEP_JOBS ?= 1
# coarse2fine.queue_stop ends a queue worker that outlived the run: kombu's file broker can hand a worker a message
# still being written (treeverse/dvc#10428), so the idle worker's shutdown, and `dvc queue stop`'s, can be lost. It
# runs `dvc queue stop` until no worker is left, then sends SIGTERM to those that missed every broadcast.
# Queuing commits the workspace, which needs a git identity: where git has none (a fresh CI machine), the sweep's own.
SWEEP_IDENTITY = $(if $(shell git config user.name && git config user.email),,\
  GIT_AUTHOR_NAME=sweep GIT_AUTHOR_EMAIL=sweep@coarse2fine.invalid GIT_COMMITTER_NAME=sweep GIT_COMMITTER_EMAIL=sweep@coarse2fine.invalid)

sweep: setup
	$(SWEEP_IDENTITY) $(BIN)/dvc exp run --queue $(SWEEP)
	$(SWEEP_IDENTITY) $(BIN)/dvc exp run --run-all --jobs $(SWEEP_JOBS)
	$(BIN)/python -m coarse2fine.queue_stop
	$(BIN)/dvc exp show --md --drop '.*' --keep 'Experiment|$(SWEEP_COLUMNS)|metrics/evaluate/.*:top1$$'

# The MLflow UI on loopback: of MLFLOW_TRACKING_URI's server when it names one (make server), else of ./mlflow.db.
# MLflow 3.17's UI starts on its GenAI view unless the address (or its sidebar switch, which the browser remembers)
# asks for model training: open the address printed first.
UI_PORT ?= 5000
TRACKING_URI = $(or $(MLFLOW_TRACKING_URI),sqlite:///mlflow.db)
EXPERIMENT_ID = $(shell $(BIN)/python -c "from mlflow import MlflowClient; e = MlflowClient('$(TRACKING_URI)').get_experiment_by_name('$(EXPERIMENT)'); print(e.experiment_id if e else 0)" 2>/dev/null)

ui: setup
	@case "$(TRACKING_URI)" in \
	  http://*|https://*) echo "open $(TRACKING_URI)/#/experiments/$(EXPERIMENT_ID)/runs?workflowType=machine_learning" \
	    "(the server's own UI: nothing to start)";; \
	  *) echo "open http://127.0.0.1:$(UI_PORT)/#/experiments/$(EXPERIMENT_ID)/runs?workflowType=machine_learning"; \
	    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --backend-store-uri $(TRACKING_URI) \
	      --host 127.0.0.1 --port $(UI_PORT);; esac

# A team's tracking server (docs/team.md): MLflow with PostgreSQL as its backend store and proxied artifacts, on
# 127.0.0.1:5000; without --db it runs a PostgreSQL cluster of its own in .mlflow-server/. E.g.
#   make server SERVER_ARGS="--db postgresql://mlflow:PASS@dbhost/mlflow --artifacts s3://bucket/mlflow --host 0.0.0.0 --auth"
SERVER_ARGS ?=
server: setup
	$(BIN)/python -m coarse2fine.server $(SERVER_ARGS)

# Move the registered model's champion alias by hand, e.g. make promote VERSION=7 (or VERSION=candidate).
promote: setup
	$(BIN)/python -m coarse2fine.promote $(VERSION)

# A GPU node (docs/gpu.md). `make wheelhouse PYTHON_VERSION=3.12`, where pip reaches PyPI: every pinned wheel but
# torch and torchvision (the node's own) for the node's Python, and the project's, in WHEELHOUSE. `make gpu-check`
# on the node: the GPU smoke tests, DALI's GPU graph, the loaders' and steps' throughput and every stage under DVC,
# reported in GPU_CHECK_OUT. Not after setup, which would install torch: the python first on PATH (.venv's if any).
.PHONY: wheelhouse gpu-check
PYTHON_VERSION ?= 3.12
WHEELHOUSE ?= wheelhouse
GPU_CHECK_OUT ?= gpu-check

wheelhouse: $(STAMP)
	$(BIN)/python scripts/gpu_wheels.py --python-version $(PYTHON_VERSION) --dest $(WHEELHOUSE)

gpu-check:
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} python3 -m coarse2fine.gpu_check --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

clean-venv:
	rm -rf $(VENV)
