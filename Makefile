# The two set-up commands of README.md: `make demo` and `make test`. Each makes its own
# virtual environment (.venv) from a fresh clone; nothing needs installing by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint typecheck check bench tune-bench reliability reliability-long fuzz-long clean install-check

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

# A plain `pip install .` (the wheel, no extras) in a fresh virtual environment: the package
# imports, says its version, runs the demo and validates its shipped plans.
install-check:
	rm -rf build/install-check && mkdir -p build/install-check
	$(PYTHON) -m venv build/install-check/venv
	build/install-check/venv/bin/python -m pip install --quiet --upgrade pip
	build/install-check/venv/bin/python -m pip wheel --quiet --no-deps -w build/install-check .
	build/install-check/venv/bin/python -m pip install --quiet build/install-check/*.whl
	cd build/install-check && venv/bin/python -c "import accy_async; print(accy_async.__version__)"
	cd build/install-check && venv/bin/python -c "import accy_bench.workload"
	cd build/install-check && venv/bin/accy-async --version
	cd build/install-check && venv/bin/accy-async demo -n 1000 --repeat 1 --quiet
	cd build/install-check && venv/bin/accy-async validate prefix_sum_f32 prefix_sum_i32 \
		prefix_sum_f32_b64 saxpy_f32 sum_f32 venv/lib/python*/site-packages/accy_async/library/plans/*.json
