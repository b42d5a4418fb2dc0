"""A vLLM OpenAI-compatible server's address and health: a free local port to start one on, and whether one
answers (its /health)."""

from __future__ import annotations

import socket


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
