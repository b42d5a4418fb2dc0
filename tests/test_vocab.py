"""Vocabulary mapping: top tokens by frequency, d2t offsets, t2d mask."""

import numpy as np
import pytest

from eaglet.errors import EagletError
from eaglet.train.vocab import build_vocab_mapping


def test_top_tokens_become_the_draft_vocab(tmp_path):
    freq = {7: 100, 3: 50, 11: 20, 0: 5, 19: 1}
    stats = build_vocab_mapping(freq, draft_vocab_size=3, vocab_size=20, out=tmp_path)
    d2t, t2d = np.load(tmp_path / "d2t.npy"), np.load(tmp_path / "t2d.npy")
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    targets = np.arange(3) + d2t
    assert targets.tolist() == [3, 7, 11]  # the three most frequent, ascending
    assert t2d.shape == (20,) and np.flatnonzero(t2d).tolist() == [3, 7, 11]
    assert stats["coverage"] == pytest.approx(170 / 176)


def test_draft_vocab_larger_than_vocab_is_refused(tmp_path):
    with pytest.raises(EagletError, match="larger than the verifier's vocabulary"):
        build_vocab_mapping({1: 1}, draft_vocab_size=50, vocab_size=20, out=tmp_path)
