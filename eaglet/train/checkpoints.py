"""speculators' epoch checkpoints: which are whole, which epoch is the draft, and the delivered draft itself."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from eaglet.train.metrics import read_metrics


def write_final_draft(epoch_dir: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """The delivered speculators checkpoint: the last epoch's weights in `dtype` (speculators' own conversion)."""
    from safetensors.torch import load_file, save_file
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype

    shutil.copy(epoch_dir / "config.json", out / "config.json")
    if (epoch_dir / "val_metrics.json").exists():
        shutil.copy(epoch_dir / "val_metrics.json", out / "val_metrics.json")
    state = convert_float_dtype(load_file(str(epoch_dir / "model.safetensors")), dtype)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    patch_config_dtype(out / "config.json", dtype)


CHECKPOINT_FILES = ("config.json", "model.safetensors", "optimizer_state_dict.pt", "scheduler_state_dict.pt")


def checkpoint_problem(epoch_dir: Path) -> str | None:
    """Why a speculators epoch checkpoint cannot be trusted (None if complete).

    speculators resumes from the highest-numbered epoch directory without checking it, so one cut short by a
    kill or a full disk would be loaded as if whole. safetensors: the header's data end must equal the file
    size; the torch .pt files are zip archives whose CRCs are checked.
    """
    import struct
    import zipfile

    for name in CHECKPOINT_FILES:
        if not (epoch_dir / name).is_file():
            return f"{name} is missing"
    st = epoch_dir / "model.safetensors"
    try:
        with open(st, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if st.stat().st_size != 8 + n + end:
            return "model.safetensors is truncated"
    except (struct.error, ValueError, KeyError):
        return "model.safetensors has no valid header"
    for name in ("optimizer_state_dict.pt", "scheduler_state_dict.pt"):
        try:
            with zipfile.ZipFile(epoch_dir / name) as z:
                if z.testzip() is not None:
                    return f"{name} is corrupt"
        except (zipfile.BadZipFile, OSError):
            return f"{name} is truncated"
    try:
        json.loads((epoch_dir / "config.json").read_text())
    except ValueError:
        return "config.json is not valid JSON"
    return None


def discard_incomplete_checkpoints(save_path: Path) -> list[str]:
    """Remove epoch checkpoints a killed run left incomplete, so speculators resumes from the last whole one."""
    removed = []
    if not save_path.is_dir():
        return removed
    for d in sorted(save_path.iterdir()):
        if d.is_dir() and not d.is_symlink() and d.name.isdigit():
            problem = checkpoint_problem(d)
            if problem:
                shutil.rmtree(d)
                removed.append(f"epoch {d.name}: {problem}")
    return removed


def last_checkpoint(save_path: Path) -> Path:
    """The newest complete epoch directory speculators wrote (config + weights)."""
    epochs = sorted(
        (p for p in save_path.iterdir() if p.is_dir() and p.name.isdigit()
         and (p / "config.json").is_file() and (p / "model.safetensors").is_file()),
        key=lambda p: int(p.name),
    )
    if not epochs:
        raise RuntimeError(f"speculators wrote no checkpoint under {save_path}")
    return epochs[-1]


def best_checkpoint(save_path: Path, metrics_file: Path,
                    score: Callable[[dict], float | None]) -> tuple[Path, float | None]:
    """The complete epoch checkpoint whose validation predicts the longest acceptance (score: the architecture's,
    DraftArchitecture.score), and that figure; the last epoch when no epoch was
    validated. speculators' own --save-best ranks by validation loss,
    which for a KL loss also rewards matching the verifier's low-probability tokens that acceptance never sees."""
    last = last_checkpoint(save_path)
    scored = {}
    for row in read_metrics(metrics_file):
        if row["kind"] == "val" and (save_path / str(row["epoch"]) / "model.safetensors").is_file():
            scored[row["epoch"]] = score(row["metrics"])  # a resumed epoch: its last row wins
    scored = {e: a for e, a in scored.items() if a is not None and int(e) <= int(last.name)}
    if not scored:
        return last, None
    epoch = max(sorted(scored, reverse=True), key=lambda e: scored[e])  # ties: the later epoch
    return save_path / str(epoch), scored[epoch]


DELIVERED_FILE = "best_epoch.json"  # in a draft_ckpt artifact: which epoch is the draft, and what it predicts


def write_delivered(draft: Path, epoch_dir: Path, predicted: float | None) -> None:
    (draft / DELIVERED_FILE).write_text(json.dumps({"epoch": int(epoch_dir.name), "predicted": predicted}))


def read_delivered(draft: Path) -> dict | None:
    """{"epoch", "predicted"} of the epoch a stored draft was delivered from, and the acceptance length its validation
    predicts (None for drafts older than the file; drafts stored before the field was renamed call it "simulated")."""
    path = draft / DELIVERED_FILE
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return {"epoch": record["epoch"], "predicted": record.get("predicted", record.get("simulated"))}
