# Two commands do all set-up: `make demo` and `make test`. Both build .venv from
# pyproject.toml, so a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint test-matrix install docs bench conformance dist clean

$(STAMP): pyproject.toml setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,ppl,docs,store]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m harvest

test: $(STAMP) lint
	$(PY) -m pytest -q -p no:cacheprovider

# ruff (lint rules and the formatter's check) over the tree, then mypy over the
# package and tests/typing/usage.py (settings in pyproject.toml: strict on the
# modules that define public names).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# The suite on every tested JAX release, one venv each (.venv-jax-<version>);
# see tests/matrix/run.py and docs/jax_versions.md.
test-matrix:
	$(PYTHON) tests/matrix/run.py

docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

bench: $(STAMP)
	$(PY) -m benchmarks

conformance: $(STAMP)
	$(PY) compat/conformance.py

# Build the sdist and wheel, check their metadata, then install the wheel into a
# fresh venv outside the checkout and run the smoke check and every docstring
# example against the installed copy (catches files missing from the wheel).
DIST_VENV := $(or $(TMPDIR),/tmp)/harvest-dist-venv
dist: $(STAMP)
	rm -rf dist $(DIST_VENV)
	mkdir -p build
	$(PY) -m pip install --quiet "build>=1.2" "twine>=6"
	$(PY) -m build --outdir dist . > build/dist.log 2>&1 || (cat build/dist.log; exit 1)
	! grep -i "deprecat" build/dist.log
	$(PY) -m twine check --strict dist/*
	$(PYTHON) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/python -m pip install --quiet "$$(ls dist/*.whl)[ppl,test,store]"
	cd $(DIST_VENV) && $(DIST_VENV)/bin/python $(CURDIR)/tests/dist/check_installed.py $(CURDIR)

clean:
	rm -rf $(VENV) .venv-jax-* docs/_build build dist *.egg-info
