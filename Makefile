# The two commands a newcomer needs: `make run` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build on machines that carry its wheel locally; the CUDA build from PyPI elsewhere.
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[worker,dev]"
	touch $@

EXAMPLE_MODEL ?= .cache/tiny-llama

run: setup
	$(PY) -m engine.testing --out $(EXAMPLE_MODEL) --hidden-size 128 --num-layers 4 >/dev/null
	$(PY) -m engine --model $(EXAMPLE_MODEL) --prompts examples/prompts.txt

test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

bench: setup
	$(PY) -m benchmarks.bench_continuous_batching
	$(PY) -m benchmarks.bench_kv_memory
	$(PY) -m benchmarks.bench_prefix_cache

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
