# The two commands of the README.
#   make demo  — set up .venv and run the demo on the sim device
#   make test  — set up .venv (with test extras) and run the test suite
.PHONY: demo test setup setup-dev

DEMO_PROMPT = $$(printf 'import os\n\n\ndef read_config(path):\n    ')

setup:
	./scripts/setup-env.sh

setup-dev:
	./scripts/setup-env.sh dev

demo: setup
	.venv/bin/dfvg generate --prompt "$(DEMO_PROMPT)"

test: setup-dev
	.venv/bin/python -m pytest -q
