"""Conversations the tests train on without generating: no vLLM needed."""

from __future__ import annotations

import json
from pathlib import Path

from eaglet.data import DEFAULT_PROMPTS, write_conversations


def write_echo_conversations(path: Path, n: int, prompts: Path = DEFAULT_PROMPTS) -> Path:
    """n conversations from `prompts` (the shipped ones), each answered with its words reversed."""
    rows = []
    for line in prompts.read_text().splitlines()[:n]:
        prompt = json.loads(line)["prompt"]
        rows.append([{"role": "user", "content": prompt},
                     {"role": "assistant", "content": " ".join(reversed(prompt.lower().split()))}])
    write_conversations(path, rows)
    return path
