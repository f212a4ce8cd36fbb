# Two entry points, each self-sufficient on a fresh machine:
#   make demo   - create/update .venv, install, train the digits demo on every rung
#   make test   - create/update .venv, install, run lint, type check and the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[demo,test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/optladder demo

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples
	$(BIN)/mypy

test: lint
	$(BIN)/pytest --durations=15

clean:
	rm -rf $(VENV) build src/*.egg-info
