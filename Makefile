# Two commands do all set-up: `make demo` and `make test`. Both build .venv from
# pyproject.toml, so a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install docs bench conformance clean

$(STAMP): pyproject.toml setup.cfg
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,ppl,docs]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m harvest

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

bench: $(STAMP)
	$(PY) -m benchmarks

conformance: $(STAMP)
	$(PY) compat/conformance.py

clean:
	rm -rf $(VENV) docs/_build build *.egg-info
