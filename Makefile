# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Installed before the package: where a CPU build of this release lies on disk (the
# project's development machines), pip takes it in seconds instead of downloading a
# CUDA build. The package itself only asks for torch>=2.11.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Ray (the extra rlcollect[ray]) is installed for tests/distributed/; where no package
# index offers it, those tests are skipped and everything else works as before.
NO_RAY := WARNING: ray could not be installed: the RayCollector tests will be skipped
# EnvPool (the extra rlcollect[envpool]) likewise, for tests/collector/test_envpool.py.
NO_ENVPOOL := WARNING: envpool could not be installed: the EnvPool tests will be skipped

.PHONY: demo test test-busy test-lab lint typecheck unit docs bench-cpu bench peers-sf clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet -e ".[ray]" || echo "$(NO_RAY)"
	$(PY) -m pip install --quiet -e ".[envpool]" || echo "$(NO_ENVPOOL)"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# The unit tests take the cores (see unit); lint, typecheck and docs (about 25 s with cold
# caches) run beside them, their output held back and printed after the tests' own. The
# target fails if any of the four failed, and says which.
test: $(STAMP)
	@logs=$$(mktemp -d); trap 'rm -rf "$$logs"' EXIT; \
	for check in lint typecheck docs; do \
	    ( $(MAKE) --no-print-directory $$check >$$logs/$$check.log 2>&1; \
	      echo $$? >$$logs/$$check.rc ) & \
	done; \
	$(MAKE) --no-print-directory unit; unit=$$?; \
	wait; failed=""; \
	[ $$unit -eq 0 ] || failed="$$failed unit"; \
	for check in lint typecheck docs; do \
	    echo "---- make $$check (ran beside the unit tests) ----"; \
	    cat $$logs/$$check.log; \
	    [ "$$(cat $$logs/$$check.rc)" = 0 ] || failed="$$failed $$check"; \
	done; \
	if [ -n "$$failed" ]; then echo "make test FAILED:$$failed"; exit 1; fi

# make test beside two CPU-busy processes, ten times: the suite must hold on a busy machine.
test-busy: $(STAMP)
	.ci/busy 2 10

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks docs/*.py
	$(VENV)/bin/ruff format --check src tests examples benchmarks docs/*.py

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# One pytest worker per core (pytest-xdist): the tests are independent, and each worker
# runs one test at a time, so a test that counts its process's fds or threads still sees
# only its own. worksteal: an idle worker takes tests queued for a busy one (the tests'
# durations range from milliseconds to a minute).
# The benchmark lab's scripts run end to end in test-lab only (about 140 s of worker time
# on 2 cores); make test imports each of them (test_every_lab_script_imports).
unit: $(STAMP)
	$(PY) -m pytest -n auto --dist worksteal -m "not lab"

test-lab: $(STAMP)
	$(PY) -m pytest -n auto --dist worksteal -m lab tests/test_examples.py

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

# Sample Factory 2.1.1 beside rlcollect (the suite's sample_factory series, issue 59) in a
# virtual environment of its own: it needs numpy<2 and gymnasium 0.29, which rlcollect's
# cannot hold. torch first (the same CPU build as above), then the rest; the series'
# Sample Factory runs are skipped, with the reason, where .peers-sf is missing.
SF_VENV := .peers-sf
SF_PACKAGES := sample-factory==2.1.1 gymnasium==0.29.1 ale-py==0.9.1 "numpy<2"
peers-sf:
	$(PYTHON) -m venv $(SF_VENV)
	$(SF_VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(SF_VENV)/bin/python -m pip install --quiet $(SF_PACKAGES)
	$(SF_VENV)/bin/python -c "import sample_factory, ale_py, gymnasium; print('sample-factory ready')"

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
