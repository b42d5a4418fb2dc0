# syntax=docker/dockerfile:1
# The image of the kubernetes-gpu work pool (deployments/work-pools/kubernetes-gpu.json, its `image` variable):
# this repository at /opt/eaglet (the template's EAGLET_REPO; prefect.yaml's pull step cds there) with the GPU stack,
# requirements-gpu.lock (vllm 0.32.0, torch 2.13.0 built for CUDA 13.0, speculators 0.9.0, prefect 3.7.7), in
# /opt/eaglet/.venv, installed by the same scripts/setup.sh as a GPU host (EAGLET_STACK=gpu: no GPU is visible
# during a build).
#
#   docker build -t <registry>/eaglet:gpu-$(git rev-parse --short HEAD) .
#   docker push <registry>/eaglet:gpu-...    # then the pool's `image` job variable names that tag
#
# Host: an NVIDIA driver for CUDA 13.0 (R580 or newer) and the NVIDIA container toolkit / device plugin. The CUDA
# libraries come from the lock's nvidia-* wheels (PyPI's torch 2.13.0 and vllm 0.32.0 use them), so the base only
# needs the CUDA driver plumbing: the small `base` flavour, not `runtime` or `devel`. About 10 GB uncompressed.
# Linted by hadolint (tests/test_gpu_lock.py); not built where it was written (no Docker daemon there).
ARG BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
FROM ${BASE_IMAGE}

# Python 3.12 (Ubuntu 24.04's; the lock resolves for 3.11 and 3.12) with venv; gcc and the Python headers for the
# C launchers Triton and flashinfer compile at run time; make for `make test` / `make demo` inside the image.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev gcc g++ make ca-certificates \
 && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    EAGLET_STACK=gpu \
    EAGLET_CHROMIUM=0 \
    EAGLET_REPO=/opt/eaglet
WORKDIR /opt/eaglet

# The lock alone first: this ~10 GB layer is rebuilt when the lock (or setup.sh) changes, not on every code change.
COPY requirements-gpu.lock pyproject.toml ./
COPY scripts/setup.sh scripts/setup.sh
RUN bash scripts/setup.sh --deps-only

# Then the checkout: setup.sh finds the lock installed, adds eaglet (editable, so the flow runs from this
# checkout) and checks that torch is a CUDA build and torch, transformers, speculators, prefect and vllm import.
COPY . .
RUN bash scripts/setup.sh

# The Kubernetes worker runs `prefect flow-run execute` in this container: the venv comes first on PATH.
ENV VIRTUAL_ENV=/opt/eaglet/.venv \
    PATH=/opt/eaglet/.venv/bin:$PATH
CMD ["prefect", "version"]
