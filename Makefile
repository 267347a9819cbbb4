# Two commands do everything on a fresh machine:
#   make demo   create .venv, install, run the end-to-end demo
#   make test   create .venv, install, lint, run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/multihead demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -q -n 2 --durations=10

bench: $(STAMP)
	$(VENV)/bin/multihead bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
