# The two set-up commands of README.md: `make demo` and `make test`. Each makes its own
# virtual environment (.venv) from a fresh clone; nothing needs installing by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint typecheck check bench tune-bench reliability reliability-long fuzz-long clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(VENV)/bin/accy-async demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

check: lint typecheck test

bench: $(STAMP)
	$(PY) benchmarks/cuda_bench.py

tune-bench: $(STAMP)
	$(PY) benchmarks/tuning_bench.py

# docs/reliability.md: fault and cancellation sweeps, fuzzing, the model, load.
reliability: $(STAMP)
	$(PY) -m tests.reliability --write

reliability-long: $(STAMP)
	$(PY) -m tests.reliability --write --long

fuzz-long: $(STAMP)
	ACCY_FUZZ_EXAMPLES=10000 ACCY_STATEFUL_EXAMPLES=1000 $(PY) -m pytest tests/test_fuzz.py tests/test_stateful.py

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache
