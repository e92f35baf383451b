# The two commands that set up a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned, so that a CPU machine takes the small CPU build instead of a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/strata generate --prompt "The quick brown fox" -n 32 --seed 1

lint: $(STAMP)
	$(BIN)/ruff check strata tests scripts

test: $(STAMP) lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
