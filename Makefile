# The two commands that set up a fresh machine: `make demo` and `make test`.
# `make demo` installs what the demo runs (torch and strata's base dependencies); `make test` adds
# the test extras, whose ggml-python and llama-cpp-python PyPI ships as sources only: they are
# built once into a wheelhouse that every later venv on the machine reuses.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
BASE := $(VENV)/.base
STAMP := $(VENV)/.installed
# Built for this machine's CPU (ggml's -march=native), so kept per machine, not shared.
WHEELS ?= $(HOME)/.cache/strata-wheels
JOBS ?= $(shell nproc)
# The versions pyproject.toml pins in its extras; a wheel of each is built once.
GGML_PYTHON := 0.0.45
LLAMA_CPP_PYTHON := 0.3.36
# Python loads libllama and libggml only: llama.cpp's multimodal library (mtmd) and its common
# library (scripts/llama_cpp_lean.cmake) are not built.
LLAMA_LEAN := $(CURDIR)/scripts/llama_cpp_lean.cmake
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(LLAMA_LEAN)

.PHONY: demo test lint install base wheels browser clean

$(BIN)/python:
	@echo "== [1/4] venv: $(VENV) from $(PY)"
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned, so that strata's install finds it there. PyPI's Linux torch is the CUDA
# build (with NVIDIA's libraries, several GB): on a machine without an NVIDIA GPU,
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes PyTorch's CPU build (a local wheelhouse
# in pip's find-links, as on this project's CI machines, is taken either way).
TORCH_INDEX ?=
TORCH_CPU := https://download.pytorch.org/whl/cpu
$(BASE): $(BIN)/python pyproject.toml
	@echo "== [2/4] base install: torch 2.13.0$(if $(TORCH_INDEX), from $(TORCH_INDEX)), then strata and its base dependencies"
	@if [ -z "$(TORCH_INDEX)" ] && ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "== no NVIDIA GPU seen: where pip finds no CPU wheel of torch, it takes the CUDA" \
			"build; make $(MAKECMDGOALS) TORCH_INDEX=$(TORCH_CPU) takes the CPU build"; fi
	$(PIP) install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q -e .
	touch $(BASE)

base: $(BASE)

# A pinned package the venv already holds is not built again; one in the wheelhouse neither.
define wheel
	@if $(BIN)/python -c "import importlib.metadata as m, sys; \
		sys.exit(m.version('$(1)') != '$(2)')" 2>/dev/null; then \
		echo "== [3/4] $(1) $(2): already in $(VENV)"; \
	elif ls $(WHEELS)/$(subst -,_,$(1))-$(2)-*.whl >/dev/null 2>&1; then \
		echo "== [3/4] $(1) $(2): wheel in $(WHEELS)"; \
	else \
		echo "== [3/4] $(1) $(2): building a wheel from source into $(WHEELS) ($(JOBS) jobs; $(3))"; \
		mkdir -p $(WHEELS); \
		CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) CMAKE_ARGS="$(4)" \
			$(PIP) wheel -q --no-deps -w $(WHEELS) $(1)==$(2) || exit 1; \
	fi
endef

wheels: $(BIN)/python
	$(call wheel,ggml-python,$(GGML_PYTHON),about 1.5 minutes on 2 cores,)
	$(call wheel,llama-cpp-python,$(LLAMA_CPP_PYTHON),about 4.5 minutes on 2 cores,$(LLAMA_CMAKE_ARGS))

$(STAMP): pyproject.toml | $(BASE)
	@$(MAKE) --no-print-directory wheels
	@echo "== [4/4] test extras: pytest, ruff, transformers, triton, ... (wheels from $(WHEELS))"
	$(PIP) install -q --find-links $(WHEELS) -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(BASE)
	$(BIN)/strata generate --prompt "The Linux kernel" -n 48 --seed 1

lint: $(STAMP)
	$(BIN)/ruff check strata tests scripts

# The chat page's browser test drives Debian's chromium through chromium-driver (selenium comes with
# the test extras). Installed with apt-get where it exists and they are missing; elsewhere, or when
# the install fails, that one test skips and says why.
BROWSER_PKGS := chromium chromium-driver
browser:
	@command -v apt-get >/dev/null 2>&1 || exit 0; \
	missing=""; for p in $(BROWSER_PKGS); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	[ -n "$$missing" ] || exit 0; \
	sudo=""; if [ "$$(id -u)" != 0 ]; then \
		if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else \
			echo "== browser test: needs$$missing; not root and no sudo, so it will skip"; exit 0; fi; \
	fi; \
	echo "== browser test: apt-get install$$missing (headless browser and its driver)"; \
	$$sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -q $$missing \
		|| echo "== browser test: apt-get failed, so it will skip"

# The suite in one process per core (pytest-xdist), each on one torch thread: most of its time is
# single-threaded (Triton's interpreter, Python), and two processes of two threads each on two cores
# took longer than one thread each (on 2 cores: 605 s, against 783 s at torch's threads, 1017 s in
# one process). At most 4: each process builds its own synthetic models and loads its own torch and
# transformers, so a many-core machine's memory is not spent on dozens of them (only 2 measured).
TEST_JOBS ?= $(shell n=$(JOBS); echo $$(( n < 4 ? n : 4 )))
test: $(STAMP) lint browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_JOBS)

clean:
	rm -rf $(VENV) build *.egg-info
