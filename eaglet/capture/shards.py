"""The artifact every capture backend writes, in speculators' on-disk format, one resumable shard at a time.

Output directory (speculators `--data-path`):
  data-*.arrow, state.json ...       HF `save_to_disk` dataset with input_ids, loss_mask, seq_len
  hidden_states/hs_{i}.safetensors   hidden_states [T, n_aux+1, H] (aux layers ascending, then the last layer,
                                     all pre-final-norm) and token_ids [T]; i = the dataset row
  token_freq.pt                      {token_id: count} over loss-masked tokens

A shard is a few samples. Its files are written under temporary names and renamed, then a record with their
sha256 (hidden_states/.shards/<n>.json). A rerun into the same directory keeps the shards whose records and files
agree and recomputes the rest, so a kill -9 costs at most the shards in flight.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglet.store import file_sha256
from eaglet.verifier import read_config_dict, text_config_of

SHARD_RECORDS = ".shards"  # hidden_states/.shards/<n>.json: a finished shard's samples and file digests


def write_shard(hs_dir: Path, n: int, idx: list[int], batch: list[list[int]], states: list[torch.Tensor],
                dtype: str, meta: dict | None = None) -> int:
    """One shard's files (temporary name, then rename), then its record with their sha256 (and `meta`, what the
    backend needs to finish the artifact later). Returns its tokens."""
    digests, tokens = {}, 0
    for i, ids, hs in zip(idx, batch, states):
        name = f"hs_{i}.safetensors"
        tmp = hs_dir / f".{name}.tmp"
        save_file({**stored_tensors(hs, dtype), "token_ids": torch.tensor(ids, dtype=torch.long)}, str(tmp))
        os.replace(tmp, hs_dir / name)
        digests[name] = file_sha256(hs_dir / name)
        tokens += len(ids)
    record = hs_dir / SHARD_RECORDS / f"{n}.json"
    record.with_suffix(".tmp").write_text(json.dumps({"samples": idx, "files": digests, **(meta or {})}))
    os.replace(record.with_suffix(".tmp"), record)
    return tokens


def stored_tensors(hs: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """The tensors of one sample's file. fp8 is hs-connectors' layout: e4m3 values + a per-token float32 scale
    (`hidden_states_scales`), which speculators' `--hidden-states-backend fp8` dequantizes when it loads."""
    if dtype == "fp8":
        from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

        values, scales = quantize_tensor_to_fp8(hs)
        return {"hidden_states": values.contiguous(), SCALES_KEY: scales.contiguous()}
    return {"hidden_states": hs.to(getattr(torch, dtype)).contiguous()}


def bytes_per_token(n_states: int, hidden_size: int, dtype: str) -> int:
    if dtype == "fp8":
        return n_states * hidden_size + 4
    return n_states * hidden_size * getattr(torch, dtype).itemsize


def shards_left(hs_dir: Path, shards: list[list[int]]) -> list[int]:
    """Numbers of the shards still to compute (creating the records directory on a first run)."""
    records = hs_dir / SHARD_RECORDS
    records.mkdir(parents=True, exist_ok=True)
    return [n for n, idx in enumerate(shards) if not _shard_done(records / f"{n}.json", idx, hs_dir)]


def _shard_done(record: Path, idx: list[int], hs_dir: Path) -> bool:
    """A finished shard: its record lists these samples and every file still has the recorded digest."""
    try:
        rec = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    if rec.get("samples") != idx:
        return False
    return all((hs_dir / name).is_file() and file_sha256(hs_dir / name) == sha for name, sha in rec["files"].items())


def read_records(hs_dir: Path) -> list[dict]:
    return [json.loads(r.read_text()) for r in sorted((hs_dir / SHARD_RECORDS).glob("*.json"),
                                                       key=lambda p: int(p.stem))]


def finish(out: Path, samples: list[dict], freq: Counter) -> dict[str, str]:
    """The dataset and token counts beside the finished shards; returns every hidden-state file's digest (taken
    as it was written) and drops the records: the store's manifest carries the digests from here on."""
    save_dataset(samples, out)
    torch.save(dict(freq), out / "token_freq.pt")
    hs_dir = out / "hidden_states"
    digests = {f"hidden_states/{name}": sha for rec in read_records(hs_dir) for name, sha in rec["files"].items()}
    shutil.rmtree(hs_dir / SHARD_RECORDS)
    return digests


def save_dataset(samples: list[dict], out: Path) -> None:
    """speculators' dataset, with a content fingerprint (datasets draws a random one for in-memory data)."""
    from datasets import Dataset

    ds = Dataset.from_list(samples)
    fingerprint = hashlib.sha256(json.dumps(samples).encode()).hexdigest()[:16]
    ds = Dataset(ds.data, info=ds.info, fingerprint=fingerprint)
    ds.set_format("torch")
    ds.save_to_disk(str(out))


def get_text_hidden_size(verifier_path: str) -> int:
    return text_config_of(read_config_dict(Path(verifier_path)))["hidden_size"]


def token_freq(path: Path) -> Counter:
    return Counter(torch.load(path / "token_freq.pt", weights_only=True))
