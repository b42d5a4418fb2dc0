# The two commands: `make demo` (set-up + the flow on the embedded SmolLM2-135M-Instruct) and `make test`.
PY := .venv/bin/python
OUT ?= out/demo

.PHONY: setup demo test test-fast clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m deployments.cli run --output-dir $(OUT)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not e2e"

clean:
	rm -rf out .pytest_cache
