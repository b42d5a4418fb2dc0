"""Draft vocabulary: the top `draft_vocab_size` tokens by frequency, as speculators' d2t / t2d tensors.

d2t[i] is an int64 offset (target id = i + d2t[i]); t2d is a bool mask over the target vocabulary.
The selection itself is speculators' `build_vocab_mappings_from_distribution`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eaglet.capture.shards import token_freq
from eaglet.errors import EagletError
from eaglet.verifier import check_draft_vocab_size
from eaglet.train.warm_start import warm_start_weights


def build_vocab_mapping(token_freq: dict[int, int], draft_vocab_size: int, vocab_size: int, out: Path) -> dict:
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    check_draft_vocab_size(draft_vocab_size, vocab_size)
    d2t, t2d = build_vocab_mappings_from_distribution(
        token_freq_dict=dict(token_freq), draft_vocab_size=draft_vocab_size, target_vocab_size=vocab_size
    )
    return _save(d2t, t2d, token_freq, out)


def kept_vocab_mapping(checkpoint: Path, token_freq: dict[int, int], draft_vocab_size: int, out: Path) -> dict:
    """A warm start's vocabulary: the d2t / t2d the checkpoint was trained with, unchanged (a new mapping would
    make its lm_head rows mean other tokens), and how well it covers this run's tokens."""
    from safetensors import safe_open

    with safe_open(str(Path(checkpoint) / "model.safetensors"), "pt") as f:
        if "d2t" not in f.keys() or "t2d" not in f.keys():
            raise EagletError(f"{checkpoint} holds no d2t / t2d vocabulary mapping: it is not an EAGLE-3 draft "
                              "checkpoint from speculators")
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    if d2t.shape[0] != draft_vocab_size:
        raise EagletError(f"the warm start {checkpoint} has a draft vocabulary of {d2t.shape[0]} tokens, this run "
                          f"{draft_vocab_size}: set draft.draft_vocab_size={d2t.shape[0]} or training.init=scratch")
    return _save(d2t, t2d, token_freq, out) | {"kept_from": str(checkpoint)}


def _save(d2t, t2d, token_freq: dict[int, int], out: Path) -> dict:
    """d2t.npy / t2d.npy, and the share of loss-masked tokens the draft vocabulary covers."""
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    total = sum(token_freq.values())
    selected = set((np.arange(d2t.shape[0]) + d2t.numpy()).tolist())
    covered = sum(c for t, c in token_freq.items() if t in selected)
    return {"draft_vocab_size": int(d2t.shape[0]), "coverage": covered / total if total else 0.0}


def build_for_run(states_dir: Path, draft_vocab_size: int, verifier_vocab_size: int, out: Path,
                  init: Path | None = None) -> dict:
    """A run's draft vocabulary in `out`: the most frequent tokens of its captured rows, or, for a warm start, the
    mapping of the draft it continues (its weights are indexed by it), with this run's coverage."""
    freq = token_freq(states_dir)
    if init is not None:
        return kept_vocab_mapping(warm_start_weights(init), freq, draft_vocab_size, out)
    return build_vocab_mapping(freq, draft_vocab_size, verifier_vocab_size, out)


def summary(stats: dict, kept: bool) -> str:
    """A vocabulary's build in a log line (kept: a warm start's own mapping)."""
    return (f"draft vocab {stats['draft_vocab_size']} covers {stats['coverage']:.1%} of training tokens"
            + (" (kept from the warm start)" if kept else ""))
