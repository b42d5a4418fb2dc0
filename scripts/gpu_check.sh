#!/usr/bin/env bash
# GPU check: the tiny verifier through the vllm extraction backend (compared with hf on the same tokens), GPU
# training defaults and the vLLM smoke-load. Usage: bash scripts/gpu_check.sh [OUT_DIR] [--allow-cpu]
# Python: $EAGLET_PYTHON if set, else .venv, else python3. It should have the GPU stack, requirements-gpu.lock (CUDA
# torch 2.13.0, vllm 0.32.0, speculators, transformers, prefect): `bash scripts/setup.sh` installs it into .venv on a
# host where a GPU is visible (EAGLET_STACK=gpu forces it). Stops after 10 minutes; OUT_DIR/summary.json (default
# out/gpu-check) has what finished.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${EAGLET_PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}" TOKENIZERS_PARALLELISM=false
exec timeout 600 "$PY" scripts/gpu_check.py "$@"
