# simkit — the README's two commands: `make figures` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export MPLBACKEND := Agg

.PHONY: install figures test bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,dist]'
	touch $(STAMP)

install: $(STAMP)

figures: $(STAMP)
	$(PY) -m simkit figures --out figures

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 tests

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
