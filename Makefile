# Two commands do everything on a fresh machine:
#   make demo   create .venv, install, run the end-to-end demo
#   make test   create .venv, install, lint, smoke-test the built wheel, run the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PIP := -m pip install -q --disable-pip-version-check
# the wheel's smoke test: a fresh venv (not even pip) with torch (the pin of requirements-dev.txt) and the
# wheel with its declared dependencies, installed by .venv's pip; --no-compile: no .pyc for all of torch
SMOKE := build/smoke
TORCH_PIN := $(shell grep -E '^torch==' requirements-dev.txt)

.PHONY: venv demo test lint wheel smoke bench clean browser

venv: $(STAMP)

# requirements-dev.txt pins everything (torch exactly: an unpinned torch pulls a multi-GB CUDA build);
# the project is then installed with its declared dependencies resolved against those pins
$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) $(PIP) -r requirements-dev.txt
	$(PY) $(PIP) --no-build-isolation -c requirements-dev.txt -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/multihead demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

wheel: $(STAMP)
	rm -rf dist
	$(PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w dist .

smoke: wheel
	@start=$$(date +%s); \
	rm -rf $(SMOKE) && $(PYTHON) -m venv --without-pip $(SMOKE)/venv && \
	$(PY) -m pip --python $(SMOKE)/venv/bin/python install -q --disable-pip-version-check --no-compile \
	  "$(TORCH_PIN)" dist/multihead-*.whl && \
	cd $(SMOKE) && venv/bin/python -W "ignore:Failed to initialize NumPy" ../../tests/wheel_smoke.py; \
	status=$$?; rm -rf $(CURDIR)/$(SMOKE); \
	echo "wheel build + fresh venv + install + smoke test: $$(( $$(date +%s) - start )) s"; exit $$status

# headless Chromium for the page tests of `multihead view` (tests/test_view.py fails without it when CI=true):
# installed with apt-get when missing and running as root (CI: a fresh Debian machine), else a hint
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else echo "make browser: no chromium on PATH; install it (apt-get install chromium) for the page tests"; fi; }

test: lint smoke browser
	$(PY) -m pytest -q -n 2 --durations=10

bench: $(STAMP)
	$(VENV)/bin/multihead bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist
