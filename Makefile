# The two commands of the README.
#   make demo  — set up .venv and run the demo on the sim device
#   make test  — set up .venv (with test extras) and run the test suite
.PHONY: demo test setup setup-dev

# pytest-xdist workers for `make test` (CI has two cores; `make test PYTEST_WORKERS=auto`
# uses every core). worksteal: the slow tests do not hold up a worker's queue.
PYTEST_WORKERS ?= 2

DEMO_PROMPT = $$(printf 'import os\n\n\ndef read_config(path):\n    ')

setup:
	./scripts/setup-env.sh

setup-dev:
	./scripts/setup-env.sh dev

demo: setup
	.venv/bin/dfvg generate --prompt "$(DEMO_PROMPT)"

# --durations: CI's log names the slowest tests, to keep the run inside its 30 minutes.
test: setup-dev
	.venv/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=25
