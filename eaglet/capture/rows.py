"""Row-level capture artifacts: each conversation's hidden states are computed once and reused by every run.

A row artifact (`<store>/rows/<key>/`) holds what the verifier made of one conversation: `hs_<j>.safetensors`
(hidden_states + token_ids, eaglet.capture.shards' tensors) for each of its samples and `row.json` (loss masks,
the verifier's answers). Its key is the digest of everything that decides those bytes: the verifier's
fingerprint, the capture settings (layers, dtype, max_seq_len, generation settings) and the request itself
(prompt token ids, after the chat template; for prefill also the loss mask). A row's key does not depend on
which file it came from, its position or its neighbours, so a file that grew by N rows costs N rows of work.

A streamed row (`<store>/row_ids/<key>/`, same key) holds only `row.json`: each sample's token ids, loss mask
and answer, no states (extraction.states stream, or rows past extraction.disk_budget_gb). Training asks the
verifier engine for its states each time it reads it; a run that keeps states computes the row again.

A run's dataset (`hidden_states/<key>/`) is an assembled view, speculators' ordinary offline layout: the HF
dataset (input_ids, loss_mask, seq_len), `hidden_states/hs_<i>.safetensors` as relative symlinks into the row
artifacts (no state is copied; none for a streamed sample, which speculators then asks the engine for),
`token_freq.pt`, and `rows.json` (row keys in sample order; which rows this run computed, which are streamed). Its manifest lists the row keys it links (`inputs.links`), so `eaglet cache
gc` never deletes a row a kept view still reads.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from eaglet import store
from eaglet.capture.shards import stored_tensors
from eaglet.capture.shards import save_dataset
from eaglet.data import reasoning_flags

ROW_KIND = "rows"
STREAMED_KIND = "row_ids"  # a streamed row: token ids and answers, no states (not reusable by a run that keeps)
ROW_FILE = "row.json"
VIEW_ROWS = "rows.json"


def row_key(verifier_fingerprint: str, settings: dict, request: dict) -> str:
    """settings: everything but the request that decides the row's bytes (layers, dtype, max_seq_len, generation)."""
    what = {"prompt_ids": request["prompt_ids"], "loss_mask": request.get("loss_mask")}
    return store.digest({"kind": ROW_KIND, "verifier": verifier_fingerprint, "settings": settings, "request": what})


def turn_key(previous_key: str, inputs: list[dict]) -> str:
    """A later assistant turn's row (data.regenerate_turns=all): the row of the turn before it (whose key holds the
    verifier, the settings and the rendered first prompt) and the messages between the two answers (user turns,
    tool results). Its prompt is known only once the earlier answers are, so it cannot be keyed by its ids."""
    return store.digest({"kind": ROW_KIND, "after": previous_key, "inputs": inputs})


def row_path(key: str) -> Path:
    return store.artifact_path(ROW_KIND, key)


def have_row(key: str) -> bool:
    return store.holds(ROW_KIND, key)


def publish_row(key: str, samples: list[dict], dtype: str) -> Path:
    """samples: [{"input_ids", "loss_mask", "hidden_states" (tensor [T, layers, H]), "response"?}] of one row."""
    def build(tmp: Path) -> None:
        import torch
        from safetensors.torch import save_file


        meta = []
        for j, s in enumerate(samples):
            save_file({**stored_tensors(s["hidden_states"], dtype), "token_ids": torch.tensor(s["input_ids"])},
                      str(tmp / f"hs_{j}.safetensors"))
            meta.append({"loss_mask": s["loss_mask"], "response": s.get("response"), "tokens": len(s["input_ids"])})
        (tmp / ROW_FILE).write_text(json.dumps({"samples": meta}))

    return store.publish(ROW_KIND, key, build, inputs={"samples": len(samples)})


def have_streamed_row(key: str) -> bool:
    return store.holds(STREAMED_KIND, key)


def publish_streamed_row(key: str, samples: list[dict]) -> Path:
    """A row whose states are not kept: samples [{"input_ids", "loss_mask", "response"?}]."""
    def build(tmp: Path) -> None:
        meta = [{"input_ids": list(s["input_ids"]), "loss_mask": list(s["loss_mask"]), "response": s.get("response"),
                 "tokens": len(s["input_ids"])} for s in samples]
        (tmp / ROW_FILE).write_text(json.dumps({"samples": meta}))

    return store.publish(STREAMED_KIND, key, build, inputs={"samples": len(samples)})


def row_bytes(key: str) -> int:
    """Bytes of a kept row's states on disk."""
    return sum(f.stat().st_size for f in row_path(key).glob("hs_*.safetensors"))


def read_row(key: str, streamed: bool = False) -> dict:
    """A row's row.json: the kept row's, or the streamed row's (with its token ids)."""
    path = store.artifact_path(STREAMED_KIND, key) if streamed else row_path(key)
    return json.loads((path / ROW_FILE).read_text())


def loss_mask(ids: list[int], mask: list[int], reasoning: tuple[int, int] | None) -> list[int]:
    """A sample's loss mask, with its reasoning blocks left out when `reasoning` (the tags' ids) is given
    (data.reasoning_in_loss=false); the row keeps the whole answer's mask, so both views share its states."""
    if reasoning is None or 1 not in mask:
        return mask
    start = mask.index(1)
    flags = [False] * start + reasoning_flags(ids, start, reasoning)
    return [m if not f else 0 for m, f in zip(mask, flags)]


def assemble(out: Path, keys: list[str], computed: set[str], streamed: set[str] = frozenset(),
             drop_reasoning: tuple[int, int] | None = None) -> dict[str, str]:
    """The run's dataset in `out` (a store work directory) from the row artifacts `keys`, in that order; the
    `streamed` ones without states (their row_ids artifacts); drop_reasoning: the reasoning tags' ids when
    reasoning is out of the loss. Returns {relative file: sha256} for the linked states (taken from the rows'
    manifests, not re-read)."""
    import torch
    from safetensors import safe_open


    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    samples, freq, digests, i = [], Counter(), {}, 0
    for key in keys:
        if key in streamed:
            for meta in read_row(key, streamed=True)["samples"]:
                mask = loss_mask(meta["input_ids"], meta["loss_mask"], drop_reasoning)
                samples.append({"input_ids": meta["input_ids"], "loss_mask": mask, "seq_len": len(meta["input_ids"])})
                freq.update(t for t, m in zip(meta["input_ids"], mask) if m)
                i += 1
            continue
        src = row_path(key)
        files = json.loads((src / store.MANIFEST).read_text())["files"]
        for j, meta in enumerate(read_row(key)["samples"]):
            name = f"hs_{j}.safetensors"
            with safe_open(str(src / name), "pt") as f:
                ids = f.get_tensor("token_ids").tolist()
            link = hs_dir / f"hs_{i}.safetensors"
            os.symlink(os.path.relpath(src / name, hs_dir), link)
            digests[f"hidden_states/hs_{i}.safetensors"] = files[name]["sha256"]
            mask = loss_mask(ids, meta["loss_mask"], drop_reasoning)
            samples.append({"input_ids": ids, "loss_mask": mask, "seq_len": len(ids)})
            freq.update(t for t, m in zip(ids, mask) if m)
            i += 1
    save_dataset(samples, out)
    torch.save(dict(freq), out / "token_freq.pt")
    (out / VIEW_ROWS).write_text(json.dumps({"rows": keys, "computed": sorted(computed),
                                             "streamed": sorted(streamed)}))
    return digests


def set_view_content(view: Path, content_key: str) -> None:
    """Record in a view with streamed samples the key of the view that would keep them (keys.states_identity)."""
    rows = json.loads((view / VIEW_ROWS).read_text())
    (view / VIEW_ROWS).write_text(json.dumps({**rows, "content": content_key}))


def view_rows(view: Path) -> dict:
    """{"rows": keys in sample order, "computed": keys this view's run computed, "streamed": keys without kept
    states} (empty for a dataset that holds its own files: the hf backend's)."""
    f = view / VIEW_ROWS
    rows = json.loads(f.read_text()) if f.is_file() else {"rows": [], "computed": []}
    return {"streamed": [], **rows}
