"""Run a vLLM job (see eaglet.vllm_worker) in a child process and return its JSON result."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

from eaglet.errors import EagletError

log = logging.getLogger("eaglet.vllm")


class VLLMError(RuntimeError):
    """vLLM failed in its child process (start-up, load or generation). Transient failures are retried."""


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    # On CPU, vLLM reserves KV cache from host RAM; its GPU-style default fraction does not fit here.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop the child and vLLM's engine processes (its own session): signalling the child alone leaves the engine
    core and its workers running, holding the model's memory. SIGTERM lets vLLM shut down; SIGKILL the rest."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


def run_vllm_job(job: dict, timeout: float | None = None, progress=None, env: dict[str, str] | None = None) -> dict:
    """progress(done, total, tokens_per_s): called after each chunk of work the child finished. env: set on top
    of vllm_env() for the child."""
    from eaglet.vllm_worker import PROGRESS

    with tempfile.TemporaryDirectory(prefix="eaglet-vllm-") as tmp:
        job = dict(job, out=str(Path(tmp) / "result.json"))
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        tail: deque[str] = deque(maxlen=40)
        proc = subprocess.Popen(
            [sys.executable, "-m", "eaglet.vllm_worker", str(job_file)], start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**vllm_env(), **(env or {})}, cwd=tmp,
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
            _stop_group(proc)
            raise
        out = Path(job["out"])
        if rc != 0 or not out.is_file():
            text = "\n".join(tail)
            if "start (0) + length" in text:
                raise EagletError(f"vLLM rejected the draft's attention shapes (head_dim mismatch):\n{text}")
            raise VLLMError(f"vLLM child process failed (exit {rc}); last output:\n{text}")
        return json.loads(out.read_text())
