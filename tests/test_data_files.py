"""The prompt files shipped in data/: readable by the data stage, no prompt twice, none of the 40 held-out prompts
among the extra ones (they must stay unseen by every run that adds them), and the held-out set a subset of the
demo's file (which is how the demo holds them out)."""

from __future__ import annotations

import json

from eaglet.data import DEFAULT_EVAL, DEFAULT_PROMPTS, prompt_part, read_conversations, row_digest

EXTRA = DEFAULT_PROMPTS.with_name("prompts-extra.jsonl")
CATEGORIES = {"chat", "writing", "code", "math", "explanation"}


def _prompts(path):
    return {row_digest(prompt_part(m)) for m in read_conversations(path)}


def test_shipped_prompt_files_parse_and_do_not_overlap():
    demo, extra, held = _prompts(DEFAULT_PROMPTS), _prompts(EXTRA), _prompts(DEFAULT_EVAL)
    assert len(held) == 40 and held <= demo
    assert len(extra) == sum(1 for line in EXTRA.open() if line.strip())  # no prompt twice in the extra file
    assert not extra & demo  # nor one of the demo's (held-out ones included)
    for path in (DEFAULT_PROMPTS, EXTRA):
        for line in path.open():
            row = json.loads(line)
            assert row["category"] in CATEGORIES and row["prompt"].strip() == row["prompt"] != ""
