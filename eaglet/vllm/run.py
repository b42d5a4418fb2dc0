"""Run a vLLM job (eaglet.vllm.worker, or another module speaking its protocol) in a child process and return its
JSON result."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

from eaglet.errors import EagletError
from eaglet.vllm.process import stop_group
from eaglet.vllm.worker import PROGRESS

log = logging.getLogger("eaglet.vllm")


class VLLMError(RuntimeError):
    """vLLM failed in its child process (start-up, load or generation). Transient failures are retried."""


# Hosts with at most this many CPUs run an offline vLLM engine's worker on all of them (see cpu_threads_bind).
SMALL_HOST_CPUS = 4


def cpu_threads_bind(cpus: set[int] | None = None) -> str | None:
    """The VLLM_CPU_OMP_THREADS_BIND for an offline engine on a small host: every CPU this process may use
    ("0,1"); None on a bigger host (vLLM's own "auto" binding applies there).

    vLLM's CPU backend ("auto", vllm/utils/ompmultiprocessing.py) reserves one core per rank for its scheduler
    and front end and binds the worker's OpenMP threads to the rest: on 2 cores the verifier's forward ran on
    ONE core. Measured on this project's 2-core machine (SmolLM2-135M float32, offline engine, greedy, one run
    each): 256 prompts x 128 tokens 227 tokens/s with "auto" against 384 with both cores bound, 40 x 128 (the
    baseline's size) 187 against 220, the same token counts. Not for the capture server (`vllm_env(all_cores=False)`):
    its API server and eaglet's client use the reserved core fully there (256 prompts x 128 tokens: 262 tokens/s
    with "auto", 241 with both cores bound). On a bigger host the reserved core costs little, and an OpenMP
    thread sharing a core with the busy scheduler would slow every parallel region, so vLLM's choice stands."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    if len(cpus) > SMALL_HOST_CPUS:
        return None
    return ",".join(str(c) for c in sorted(cpus))


def vllm_env(all_cores: bool = False) -> dict[str, str]:
    """The environment of a vLLM child process. all_cores: an offline engine (see cpu_threads_bind)."""
    env = dict(os.environ)
    # On CPU, vLLM reserves KV cache from host RAM; its GPU-style default fraction does not fit here.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    bind = cpu_threads_bind() if all_cores else None
    if bind is not None:  # a CPU-backend setting: GPU runs ignore it
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_job(job: dict, timeout: float | None = None, progress=None, env: dict[str, str] | None = None,
            module: str = "eaglet.vllm.worker") -> dict:
    """progress(done, total, tokens_per_s): called after each chunk of work the child finished. env: set on top
    of vllm_env() for the child. module: the child's `python -m` module (eaglet.vllm.worker.serve's protocol)."""
    with tempfile.TemporaryDirectory(prefix="eaglet-vllm-") as tmp:
        job = dict(job, out=str(Path(tmp) / "result.json"))
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        tail: deque[str] = deque(maxlen=40)
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(job_file)], start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp,
            env={**vllm_env(all_cores=True), **(env or {})},
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                line = line.rstrip()
                tail.append(line)
                if line.startswith(PROGRESS):
                    p = json.loads(line[len(PROGRESS):])
                    if progress:
                        progress(p["done"], p["total"], p["tokens_per_s"])
                    else:
                        log.info(f"{p['done']}/{p['total']} done, {p['tokens_per_s']:.0f} tokens/s")
                else:
                    log.debug(line)
            rc = proc.wait(timeout=timeout)
        except BaseException:  # interrupted here (a cancelled run, a failing callback): stop vLLM too
            stop_group(proc.pid)
            proc.wait()
            raise
        out = Path(job["out"])
        if rc != 0 or not out.is_file():
            text = "\n".join(tail)
            if "start (0) + length" in text:
                raise EagletError(f"vLLM rejected the draft's attention shapes (head_dim mismatch):\n{text}")
            raise VLLMError(f"vLLM child process failed (exit {rc}); last output:\n{text}")
        return json.loads(out.read_text())
