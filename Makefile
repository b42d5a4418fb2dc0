# The two commands: `make demo` (set-up + the flow on the embedded SmolLM2-135M-Instruct) and `make test`.
PY := .venv/bin/python
OUT ?= out/demo

.PHONY: setup demo test test-fast bench stack-up stack-down clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m deployments.cli run --output-dir $(OUT)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not e2e"

bench: setup  # every stage against its limit: bench/results/<date>-<cpu>-full.{json,md} (about 45 min on 2 cores)
	$(PY) -m bench.run --preset full

stack-up: setup  # Prefect server on 127.0.0.1:4200 + work pool + prefect.yaml's deployments + a worker
	$(PY) -m deployments.cli stack up

stack-down:
	$(PY) -m deployments.cli stack down

clean:
	rm -rf out .pytest_cache
