"""What a warm start trains on: the rows its lineage never saw, plus a fixed fraction of those it did
(training.warm_replay_fraction), as a dataset view of links to the row artifacts (eaglet.capture.rows)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from eaglet.capture.rows import assemble, view_rows
from eaglet.train.lineage import seen_rows

REPLAY_VIEW = "replay_view"  # in a draft_ckpt work dir while it trains; removed once the draft is delivered


def replayed(key: str, fraction: float) -> bool:
    """Whether an already-seen row is replayed: a fixed choice per row key, so every night replays the same ones."""
    return int(hashlib.sha256(f"replay/{key}".encode()).hexdigest()[:8], 16) < fraction * 0x100000000


def training_view(states_dir: Path, init: Path, fraction: float, out: Path) -> dict | None:
    """The view a warm start trains on in `out`, or None when it is the whole states view (fraction 1, a view
    without row artifacts, or nothing seen). Returns {"rows", "new", "replayed"}."""
    view = view_rows(states_dir)
    rows = view["rows"]
    seen = seen_rows(init) if fraction < 1 and rows else set()
    if not seen & set(rows):
        return None
    chosen = [k for k in rows if k not in seen or replayed(k, fraction)]
    new = sum(1 for k in rows if k not in seen)
    assemble(out, chosen, set(), set(view["streamed"]) & set(chosen))
    return {"rows": len(chosen), "new": new, "replayed": len(chosen) - new}
