"""A vLLM OpenAI-compatible server's address and health: a free local port to start one on, whether one answers
(its /health), and waiting for a server this process started until it does."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def healthy(endpoint: str) -> bool:
    import httpx  # the orchestrating process's client; vLLM children have it too

    try:
        return httpx.get(f"{endpoint}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(proc: subprocess.Popen, endpoint: str, timeout: float = 3600, what: str = "the vLLM server") -> None:
    """Until the server started as `proc` answers; it exiting first, or not answering within timeout s, raises."""
    t0 = time.monotonic()
    while not healthy(endpoint):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited (code {proc.returncode}) while loading")
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"{what} did not answer within {timeout:.0f} s")
        time.sleep(0.5)
