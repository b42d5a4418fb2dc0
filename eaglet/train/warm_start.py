"""Warm starts: which stored draft a run may continue (never one whose lineage saw its held-out prompts), what it
loads, and the lineage record every trained draft carries."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from eaglet.config import TrainingParams
from eaglet.errors import EagletError, read_json_file
from eaglet.train.checkpoints import last_checkpoint, read_delivered
from eaglet.train.lineage import read_lineage


def check_init_dir(path: str | Path, architecture: str) -> None:
    """training.init given as a path: a speculators checkpoint (config + weights) of the run's draft architecture,
    checked before any load."""
    p = Path(path)
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise EagletError(f"training.init={path} is not a speculators checkpoint directory (config.json and "
                          "model.safetensors); use 'scratch', 'previous' or such a directory")
    kind = read_json_file(p / "config.json", "training.init config").get("speculators_model_type")
    if kind != architecture:
        raise EagletError(f"training.init={path} is a speculators {kind!r} checkpoint, but draft.architecture is "
                          f"{architecture}: warm-start from a draft of the same architecture, or use 'scratch'")


def warm_start_weights(draft: Path) -> Path:
    """What a warm start loads: the float32 epoch checkpoint a stored draft was delivered from (older drafts: the
    last epoch) when it has one, else the directory itself (a delivered draft, bfloat16)."""
    epochs = draft / "checkpoints"
    if epochs.is_dir():
        with contextlib.suppress(RuntimeError):
            delivered = read_delivered(draft)
            chosen = epochs / str(delivered["epoch"]) if delivered else None
            return chosen if chosen and (chosen / "model.safetensors").is_file() else last_checkpoint(epochs)
    return draft


def warm_start_decision(candidate: Path | None, held_out: set[str], explicit: bool) -> dict:
    """Whether training may start from `candidate`: never from a draft whose lineage trained on one of the run's
    held-out prompts (the run would then be measured on prompts its draft has seen). A draft with no lineage
    record is refused when found automatically ('previous'); a directory the user names is taken, its overlap
    reported as unknown."""
    n = len(held_out)
    if candidate is None:
        return {"from": None, "held_out_seen": None, "reason": "no earlier draft of this shape in the store: "
                "training from scratch"}
    lineage = read_lineage(candidate)
    if lineage is None or not lineage["known"]:
        if explicit:
            return {"from": str(candidate), "held_out_seen": None, "reason": f"warm start from {candidate}; it has "
                    "no eaglet lineage record, so whether it saw the held-out prompts is not known"}
        return {"from": None, "held_out_seen": None, "reason": f"refused the warm start from {candidate.name}: it "
                "records no complete lineage (trained before eaglet kept one), so it may have trained on held-out "
                "prompts; training from scratch"}
    seen = len(held_out & set(lineage["prompts"]))
    if seen:
        return {"from": None, "held_out_seen": seen, "reason": f"refused the warm start from {candidate.name}: it or "
                f"a draft it was warm-started from trained on {seen} of this run's {n} held-out prompts; training "
                "from scratch"}
    return {"from": str(candidate), "held_out_seen": 0, "reason": f"warm start from {candidate.name}; its lineage "
            f"({len(lineage['drafts']) + 1} drafts) trained on none of the {n} held-out prompts"}


def find_previous(drafts_dir: Path, shape: str, states: str) -> Path | None:
    """The most recent stored draft (`drafts_dir/<key>`, manifest inputs) of this shape trained on other data
    than `states`: a rerun over the same data finds the same draft again, so its training stays cached."""
    best, newest = None, -1.0
    for manifest in drafts_dir.glob("*/manifest.json") if drafts_dir.is_dir() else []:
        m = json.loads(manifest.read_text())
        inputs = m.get("inputs", {})
        if inputs.get("shape") == shape and inputs.get("states") != states and m["created"] > newest:
            best, newest = manifest.parent, m["created"]
    return best


def resolve_init(init: str, drafts_dir: Path, shape: str, states: str, held_out: set[str]) -> dict:
    """training.init resolved for a run: {"requested", "from": a checkpoint directory or None (scratch), "reason",
    "held_out_seen"}; 'previous' is the newest stored draft of this shape (find_previous)."""
    candidate = find_previous(drafts_dir, shape, states) if init == "previous" else Path(init).resolve()
    return {"requested": init, **warm_start_decision(candidate, held_out, explicit=init != "previous")}


def run_training(init: str | Path | None, training: TrainingParams) -> TrainingParams:
    """The training settings a run actually uses. A warm start trains training.warm_epochs (when set) at
    warm_lr_fraction of the learning rate, with warm_warmup_steps (when set); from scratch, training as given."""
    if not init:
        return training
    update: dict = {"lr": training.lr * training.warm_lr_fraction}
    if training.warm_epochs:
        update["epochs"] = training.warm_epochs
    if training.warm_warmup_steps is not None:
        update["warmup_steps"] = training.warm_warmup_steps
    return training.model_copy(update=update)
