# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Installed before the package: where a CPU build of this release lies on disk (the
# project's development machines), pip takes it in seconds instead of downloading a
# CUDA build. The package itself only asks for torch>=2.11.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit docs bench-cpu bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: lint typecheck unit docs

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks docs/*.py
	$(VENV)/bin/ruff format --check src tests examples benchmarks docs/*.py

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest

# The site, into site/ (git-ignored). --strict turns every warning into a failure: a
# broken link, a docstring cross-reference to a name the API reference does not show,
# a docstring section mkdocstrings cannot parse.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench-cpu: $(STAMP)
	$(PY) benchmarks/cpu_collection.py

# The benchmark suite's CPU half (about 14 minutes on 2 cores; results in
# benchmarks/results/suite_cpu/), then the results page docs/results.md and its plots.
# The GPU half runs on a CUDA machine: python -m benchmarks gpu --part 1|2|3.
bench: $(STAMP)
	$(PY) -m benchmarks cpu
	$(PY) -m benchmarks report

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
