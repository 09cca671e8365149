# Two entry points: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned here (not in pyproject.toml) so pip takes the local CPU wheel instead of a CUDA download.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.dynatrain-setup

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/dynatrain fit --config recipes/llama-debug-elastic.yaml --elastic.max_devices 4 --elastic.standby 2

# Two pytest workers: a multi-process test leaves cores idle while its ranks wait on each other, so two tests at once
# fill them (about 10 instead of 20 minutes on 2 cores). tests/conftest.py keeps a module whose tests share one
# reference run on one worker.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15 tests

bench: setup
	$(PY) bench/all.py

clean:
	rm -rf runs lightning_logs .pytest_cache
