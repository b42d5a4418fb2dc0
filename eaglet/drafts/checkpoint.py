"""A draft directory on disk, whatever its architecture: its config, its safetensors weights (read by name and
shape without loading), and writing a new directory whole or not at all."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from safetensors import safe_open

from eaglet.errors import EagletError, read_json_file


def draft_weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise EagletError(f"{path} has no model.safetensors (or sharded index): not a draft checkpoint")


def read_config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise EagletError(f"{path} has no config.json: give the directory of a draft checkpoint")
    return read_json_file(path / "config.json", "draft config")


def is_nested(cfg: dict) -> bool:
    """speculators' own format (a speculators_config and the decoder's transformer_layer_config)."""
    return "speculators_config" in cfg and "transformer_layer_config" in cfg


def tensor_meta(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, safetensors dtype) without reading any tensor data."""
    meta = {}
    for file in draft_weight_files(path):
        with safe_open(str(file), "pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                meta[k] = (list(s.get_shape()), s.get_dtype())
    return meta


def load_tensors(path: Path) -> dict:
    import torch  # noqa: F401  safetensors' pt framework needs torch (heavy: imported only when tensors load)

    out = {}
    for file in draft_weight_files(path):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def load_tensor(path: Path, name: str):
    for file in draft_weight_files(path):
        with safe_open(str(file), "pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(name)


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def staged_output(src: Path, dst: Path):
    """Yield an empty temporary directory beside `dst`, then rename it to `dst`.

    Converting onto the source moves the source to `<src>.bak` first; any other existing `dst` is refused, so
    nothing is overwritten and nothing half-written is ever visible under `dst`.
    """
    in_place = dst.resolve() == src.resolve()
    backup = src.with_name(src.name + ".bak")
    if in_place and backup.exists():
        raise EagletError(f"{backup} exists: move it away before converting {src} in place")
    if not in_place and dst.exists():
        raise EagletError(f"{dst} exists: choose another --out or remove it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if in_place:
            os.rename(src, backup)
        os.rename(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
