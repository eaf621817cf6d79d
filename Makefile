# Two commands matter: `make demo` and `make test`. Both install what is missing into .venv first.
# Without an NVIDIA GPU torch 2.13.0 is pinned: CI's machines find its CPU build on disk. Elsewhere PyPI's Linux
# wheel is the CUDA build; TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cpu' takes the CPU one.
TORCH_PIP_ARGS ?=
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
TINY ?= .tiny-model

.PHONY: install demo test test-fast tiny-model clean soak

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS); fi
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*; touch $@

tiny-model: $(STAMP)
	test -f $(TINY)/config.json || $(PY) -m llmserve_core make-tiny-model $(TINY) --draft $(TINY)-eagle3

# The demo serves the shipped trained tiny pair (Qwen3 + EAGLE-3 draft); `make tiny-model` writes a
# random one (with its draft) for experiments.
demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

# The suite without the tests marked slow (the soak's and tensor parallelism's longest multi-process
# runs): for a quicker check while working; `make test` runs everything.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) $(TINY) .pytest_cache

# A randomized soak of a core and HTTP frontend on the CPU tiny model; SOAK_SECONDS=1800 for a long one.
SOAK_SECONDS ?= 60
soak: $(STAMP)
	$(PY) -m llmserve_bench soak --duration $(SOAK_SECONDS) --result-json soak.json
