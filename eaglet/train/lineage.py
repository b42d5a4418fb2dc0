"""Every trained draft's lineage: the prompts it and its warm-start ancestors trained on (what a later run checks
against its held-out prompts), and the rows they saw (what a warm start's replay counts as seen)."""

from __future__ import annotations

import json
from pathlib import Path

from eaglet import store
from eaglet.capture.rows import view_rows
from eaglet.data import prompt_digests

LINEAGE_FILE = "lineage.json"  # in a draft_ckpt artifact: every prompt the draft and its warm-start ancestors saw


def write_lineage(draft: Path, train_file: Path, init: Path | None, rows: list[str] | None = None) -> dict:
    """Record the prompts a draft trained on, with those of the draft it was warm-started from: what a later run
    checks against its held-out prompts. An ancestor without a record leaves the lineage unknown. rows: the row
    keys of its states (what a later warm start's replay counts as seen)."""
    parent = read_lineage(init) if init else {"known": True, "prompts": [], "drafts": []}
    known = parent is not None and parent["known"]
    record = {"known": known, "drafts": ([init.name] + parent["drafts"]) if init and parent else [],
              "prompts": sorted(prompt_digests(train_file) | set(parent["prompts"] if parent else []))}
    if rows is not None:
        record["rows"] = sorted(set(rows) | (seen_rows(init) if init else set()))
    (draft / LINEAGE_FILE).write_text(json.dumps(record))
    return record


def read_lineage(draft: Path) -> dict | None:
    """{"known", "drafts", "prompts"} of a draft eaglet trained (None: no record, e.g. a draft made elsewhere)."""
    path = draft / LINEAGE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


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


def prompts_seen(draft: Path) -> set[str]:
    """Prompt digests a draft and its warm-start ancestors trained on (empty for a draft with no eaglet record:
    nothing known to leave out of an evaluation)."""
    return set((read_lineage(draft) or {}).get("prompts", []))
