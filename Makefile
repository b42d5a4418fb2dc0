# The two commands: `make demo` (set-up + the flow on the embedded SmolLM2-135M-Instruct) and `make test`.
PY := .venv/bin/python
OUT ?= out/demo

.PHONY: setup demo demo-large test test-fast bench bench-peer stack-up stack-down clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m deployments.cli run --output-dir $(OUT)

# The demo's prompts + data/prompts-extra.jsonl (2,081 training prompts, the same 40 held out): the draft worth
# serving (acceptance 1.895 at k=3, measured), 41.6 minutes cold on 2 CPU cores against the demo's 19.
LARGE_OUT ?= out/demo-large
demo-large: setup
	mkdir -p out && cat data/prompts.jsonl data/prompts-extra.jsonl > out/prompts-large.jsonl
	$(PY) -m deployments.cli run --output-dir $(LARGE_OUT) --set data.path=$(CURDIR)/out/prompts-large.jsonl \
		--set data.eval_path=$(CURDIR)/data/eval.jsonl

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not e2e"

bench: setup  # every stage against its limit: bench/results/<date>-<cpu>-full.{json,md} (about 45 min on 2 cores)
	$(PY) -m bench.run --preset full

bench-peer: setup  # speculators' own CLI pipeline beside eaglet's cold demo, both drafts under eaglet eval
	$(PY) -m bench.run --preset peer

stack-up: setup  # Prefect server on 127.0.0.1:4200 + work pool + prefect.yaml's deployments + a worker
	$(PY) -m deployments.cli stack up

stack-down:
	$(PY) -m deployments.cli stack down

clean:
	rm -rf out .pytest_cache
