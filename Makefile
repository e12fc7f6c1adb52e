# Every target bootstraps .venv idempotently; a fresh clone needs nothing else.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_MODEL ?= $(HOME)/.cache/serve-app/models/demo-llama

.PHONY: venv serve test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# NOTE: torch first, pinned, so pip takes the CPU wheel on disk instead of a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# `make serve MODEL=/path/to/checkpoint` serves a real checkpoint; SERVE_ARGS adds flags.
MODEL ?=
SERVE_ARGS ?=

serve: $(STAMP)
ifeq ($(strip $(MODEL)),)
	test -f $(DEMO_MODEL)/config.json || $(VENV)/bin/serve-app make-model $(DEMO_MODEL) --arch llama --preset tiny
	$(VENV)/bin/serve-app serve --model $(DEMO_MODEL) $(SERVE_ARGS)
else
	$(VENV)/bin/serve-app serve --model $(MODEL) $(SERVE_ARGS)
endif

lint: $(STAMP)
	$(VENV)/bin/ruff check actors serve_app tests benchmarks

test: $(STAMP) lint
	$(PY) -m pytest -q

# Every benchmark, one after the other (each needs the cores to itself); JSON + PNG each.
bench: $(STAMP)
	mkdir -p benchmarks/results
	$(PY) benchmarks/engine.py --out benchmarks/results/engine.json
	$(PY) benchmarks/serving.py --out benchmarks/results/serving.json
	$(PY) benchmarks/serving.py --replicas 1,2 --out benchmarks/results/replicas.json
	$(PY) benchmarks/peer.py --out benchmarks/results/peer.json
	$(PY) benchmarks/peer.py --dtype bfloat16 --out benchmarks/results/peer_bf16.json
	$(PY) benchmarks/batch.py --out benchmarks/results/batch.json
	$(PY) benchmarks/lifecycle.py --out benchmarks/results/lifecycle.json
	$(PY) benchmarks/serve_hop.py --out benchmarks/results/serve_hop.json

clean:
	rm -rf $(VENV) .pytest_cache
