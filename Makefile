# Every target that needs the project depends on `install`, which is idempotent:
# it rebuilds .venv only when pyproject.toml changes.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
# extra options for `make demo`, e.g. DEMO_ARGS="--model tiny --chars 2000"
DEMO_ARGS ?=

.PHONY: install demo test bench lint format clean reliability

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[s3,redis,worker,dev]" "$(TORCH_PIN)"
	touch $(STAMP)

demo: install
	$(BIN)/python -m workers.demo $(DEMO_ARGS)

test: install
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
	rm -rf $(VENV) .kvcloud-demo .pytest_cache

reliability: install
	$(BIN)/python scripts/reliability_report.py --out docs/RELIABILITY.md
