# Two entry points, each self-sufficient on a fresh machine:
#   make demo   - create/update .venv, install optladder with the demo's extra, run the demo
#   make test   - create/update .venv, install the test extra too, run lint, type check, tests
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

# Every pip call below is pinned by constraints.txt (torch==2.13.0+cpu, the CPU build), so
# no dependency can swap the installed torch for another build, CUDA's included.
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: $(BIN)/python constraints.txt
	$(BIN)/pip install -q "torch==2.13.0"
	touch $@

$(VENV)/.demo: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -q -e ".[demo]"
	touch $@

$(VENV)/.test: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -q -e ".[demo,test]"
	touch $@ $(VENV)/.demo

demo: $(VENV)/.demo
	$(BIN)/optladder demo

lint: $(VENV)/.test
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy

test: lint
	$(BIN)/pytest --durations=15

clean:
	rm -rf $(VENV) build src/*.egg-info
