# Two entry points: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned here (not in pyproject.toml) so pip takes the local CPU wheel instead of a CUDA download.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.dynatrain-setup

.PHONY: setup demo test test-lightning-min bench clean

setup: $(STAMP)

# LitData (the streaming tests) without its own requirements: they pull torchvision, which replaces the pinned torch
# with a multi-GB CUDA build. What LitData imports comes from the second line, with the torch pin held.
LITDATA_PIN ?= litdata>=0.2.76,<0.3
LITDATA_DEPS := lightning-utilities filelock numpy requests "urllib3>=1.26" obstore tifffile boto3

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps "$(LITDATA_PIN)"
	$(PY) -m pip install -q --disable-pip-version-check --no-warn-conflicts $(LITDATA_DEPS) "$(TORCH_PIN)"
	@touch $(STAMP)

# The two members left after the scale-in keep both cores busy, so the leavers' start-up as standby processes gets
# only what their niceness leaves it: at 2 they are ready within about 5 steps of the scale-out's request (at the
# default 4, about a dozen, close to the re-layout the trace requests next; docs/elastic.md).
demo: setup
	$(VENV)/bin/dynatrain fit --config recipes/llama-debug-elastic.yaml --elastic.max_devices 4 --elastic.standby 2 \
		--elastic.standby_nice 2

# Two pytest workers: a multi-process test leaves cores idle while its ranks wait on each other, so two tests at once
# fill them (about 10 instead of 20 minutes on 2 cores). tests/conftest.py keeps a module whose tests share one
# reference run on one worker.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15 tests

# The lowest Lightning release dynatrain supports: pyproject.toml's lower bound, which tests/test_lightning_support.py
# checks this equals. `make test` runs everything on the newest Lightning pyproject.toml admits; this runs the tests
# that lean most on Lightning's loops (step accounting through switches, the data split's batch limits, resumes and
# joiners from the loop state) on the lowest, in a venv of its own. The selfcheck tests (a DCP oracle through the same
# switches, the slowest) are left to `make test`, to keep this within about 5 minutes on 2 cores from a fresh venv.
LIGHTNING_MIN := 2.6.0

.venv-lightning-min/.dynatrain-setup-$(LIGHTNING_MIN): pyproject.toml
	@test -x .venv-lightning-min/bin/python || $(PYTHON) -m venv .venv-lightning-min
	.venv-lightning-min/bin/python -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	.venv-lightning-min/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]' "lightning==$(LIGHTNING_MIN)"
	@rm -f .venv-lightning-min/.dynatrain-setup-* && touch $@

test-lightning-min: .venv-lightning-min/.dynatrain-setup-$(LIGHTNING_MIN)
	.venv-lightning-min/bin/python -c "import lightning; assert lightning.__version__ == '$(LIGHTNING_MIN)', lightning.__version__"
	.venv-lightning-min/bin/python -m pytest -q -n $(TEST_WORKERS) --durations=10 -k "not selfcheck" \
	  tests/test_lightning_support.py tests/test_registration.py tests/test_training_mp.py tests/test_switch_mp.py \
	  tests/test_data_split_mp.py

bench: setup
	$(PY) bench/all.py

clean:
	rm -rf runs lightning_logs .pytest_cache
