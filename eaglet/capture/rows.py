"""Row-level capture artifacts: each conversation's hidden states are computed once and reused by every run.

A row artifact (`<store>/rows/<key>/`) holds what the verifier made of one conversation: `hs_<j>.safetensors`
(hidden_states + token_ids, eaglet.capture.shards' tensors) for each of its samples and `row.json` (loss masks,
the verifier's answers). Its key is the digest of everything that decides those bytes: the verifier's
fingerprint, the capture settings (layers, dtype, max_seq_len, generation settings) and the request itself
(prompt token ids, after the chat template; for prefill also the loss mask). A row's key does not depend on
which file it came from, its position or its neighbours, so a file that grew by N rows costs N rows of work.

A run's dataset (`hidden_states/<key>/`) is an assembled view, speculators' ordinary offline layout: the HF
dataset (input_ids, loss_mask, seq_len), `hidden_states/hs_<i>.safetensors` as relative symlinks into the row
artifacts (no state is copied), `token_freq.pt`, and `rows.json` (row keys in sample order; which rows this
run computed and which it reused). Its manifest lists the row keys it links (`inputs.links`), so `eaglet cache
gc` never deletes a row a kept view still reads.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from eaglet import store

ROW_KIND = "rows"
ROW_FILE = "row.json"
VIEW_ROWS = "rows.json"


def row_key(verifier_fingerprint: str, settings: dict, request: dict) -> str:
    """settings: everything but the request that decides the row's bytes (layers, dtype, max_seq_len, generation)."""
    what = {"prompt_ids": request["prompt_ids"], "loss_mask": request.get("loss_mask")}
    return store.digest({"kind": ROW_KIND, "verifier": verifier_fingerprint, "settings": settings, "request": what})


def row_path(key: str) -> Path:
    return store.artifact_path(ROW_KIND, key)


def have_row(key: str) -> bool:
    path = row_path(key)
    return store.is_published(path) and store.intact(path)


def publish_row(key: str, samples: list[dict], dtype: str) -> Path:
    """samples: [{"input_ids", "loss_mask", "hidden_states" (tensor [T, layers, H]), "response"?}] of one row."""
    def build(tmp: Path) -> None:
        import torch
        from safetensors.torch import save_file

        from eaglet.capture.shards import _stored

        meta = []
        for j, s in enumerate(samples):
            save_file({**_stored(s["hidden_states"], dtype), "token_ids": torch.tensor(s["input_ids"])},
                      str(tmp / f"hs_{j}.safetensors"))
            meta.append({"loss_mask": s["loss_mask"], "response": s.get("response"), "tokens": len(s["input_ids"])})
        (tmp / ROW_FILE).write_text(json.dumps({"samples": meta}))

    return store.publish(ROW_KIND, key, build, inputs={"samples": len(samples)})


def read_row(key: str) -> dict:
    return json.loads((row_path(key) / ROW_FILE).read_text())


def assemble(out: Path, keys: list[str], computed: set[str]) -> dict[str, str]:
    """The run's dataset in `out` (a store work directory) from the row artifacts `keys`, in that order.
    Returns {relative file: sha256} for the linked states (taken from the rows' manifests, not re-read)."""
    import torch
    from safetensors import safe_open

    from eaglet.capture.shards import save_dataset

    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    samples, freq, digests, i = [], Counter(), {}, 0
    for key in keys:
        src = row_path(key)
        files = json.loads((src / store.MANIFEST).read_text())["files"]
        for j, meta in enumerate(read_row(key)["samples"]):
            name = f"hs_{j}.safetensors"
            with safe_open(str(src / name), "pt") as f:
                ids = f.get_tensor("token_ids").tolist()
            link = hs_dir / f"hs_{i}.safetensors"
            os.symlink(os.path.relpath(src / name, hs_dir), link)
            digests[f"hidden_states/hs_{i}.safetensors"] = files[name]["sha256"]
            samples.append({"input_ids": ids, "loss_mask": meta["loss_mask"], "seq_len": len(ids)})
            freq.update(t for t, m in zip(ids, meta["loss_mask"]) if m)
            i += 1
    save_dataset(samples, out)
    torch.save(dict(freq), out / "token_freq.pt")
    (out / VIEW_ROWS).write_text(json.dumps({"rows": keys, "computed": sorted(computed)}))
    return digests


def view_rows(view: Path) -> dict:
    """{"rows": keys in sample order, "computed": keys this view's run computed} (empty for a dataset that holds
    its own files: the hf backend's)."""
    f = view / VIEW_ROWS
    return json.loads(f.read_text()) if f.is_file() else {"rows": [], "computed": []}
