"""What a warm start trains on: the rows its lineage never saw, plus a fixed fraction of those it did
(training.warm_replay_fraction), as a dataset view of links to the row artifacts (eaglet.capture.rows)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eaglet import store
from eaglet.capture.rows import assemble, view_rows
from eaglet.train.warm_start import read_lineage

REPLAY_VIEW = "replay_view"  # in a draft_ckpt work dir while it trains; removed once the draft is delivered


def seen_rows(draft: Path) -> set[str]:
    """Row keys a stored draft and its warm-start ancestors trained on: its lineage's record, or, for a draft
    trained before lineages kept rows, its manifest chain (the states view it trained on, then its own init)."""
    record = read_lineage(draft) or {}
    if "rows" in record:
        return set(record["rows"])
    manifest = draft / store.MANIFEST
    if not manifest.is_file():
        return set()
    inputs = json.loads(manifest.read_text()).get("inputs", {})
    rows = set(view_rows(store.artifact_path("hidden_states", inputs["states"]))["rows"]) if inputs.get("states") \
        else set()
    if inputs.get("init"):
        rows |= seen_rows(Path(inputs["init"]))
    return rows


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
