"""Draft vocabulary: the top `draft_vocab_size` tokens by frequency, as speculators' d2t / t2d tensors.

d2t[i] is an int64 offset (target id = i + d2t[i]); t2d is a bool mask over the target vocabulary.
The selection itself is speculators' `build_vocab_mappings_from_distribution`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eaglet.errors import EagletError


def check_draft_vocab_size(draft_vocab_size: int, vocab_size: int) -> None:
    if draft_vocab_size > vocab_size:
        raise EagletError(
            f"draft.draft_vocab_size={draft_vocab_size} is larger than the verifier's vocabulary ({vocab_size}); "
            f"use at most {vocab_size}"
        )


def build_vocab_mapping(token_freq: dict[int, int], draft_vocab_size: int, vocab_size: int, out: Path) -> dict:
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    check_draft_vocab_size(draft_vocab_size, vocab_size)
    d2t, t2d = build_vocab_mappings_from_distribution(
        token_freq_dict=dict(token_freq), draft_vocab_size=draft_vocab_size, target_vocab_size=vocab_size
    )
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    total = sum(token_freq.values())
    selected = set((np.arange(draft_vocab_size) + d2t.numpy()).tolist())
    covered = sum(c for t, c in token_freq.items() if t in selected)
    return {"draft_vocab_size": draft_vocab_size, "coverage": covered / total if total else 0.0}
