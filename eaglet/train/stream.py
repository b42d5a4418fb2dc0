"""Streamed states: speculators' own online path (its dataset asks a vLLM `extract_hidden_states` server for a
sample whose `hs_<i>.safetensors` is missing, reads the file the connector wrote and deletes it), pointed at
eaglet's capture engine. Two adjustments, both here:

- speculators' client refuses a server whose `/v1/models` id differs from `--verifier-name-or-path`
  (`ArrowDataset._setup_client`), which is also the local path it loads the verifier's embeddings and head from;
  eaglet's engines serve under a name that carries the fingerprint and the captured layers
  (eaglet.capture.engine.served_name), so the datasets are given that name instead.
- a streamed sample's states arrive in the engine's dtype; they are rounded to extraction.dtype exactly as a kept
  row's are when it is stored (eaglet.capture.shards._stored), so a streamed sample trains on the same numbers
  as a kept one.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch

from eaglet.capture.shards import stored_tensors

class StoredDtypeTransfer:
    """speculators' hidden-states transfer, with generated samples rounded to the stored dtype."""

    def __init__(self, inner, dtype: str):
        self.inner, self.dtype = inner, dtype

    def setup(self) -> None:
        self.inner.setup()

    def get_cached(self, file_idx: int):
        return self.inner.get_cached(file_idx)

    def get_generated(self, params: dict[str, Any]):
        sample = self.inner.get_generated(params)
        if sample is not None:
            sample = dict(sample, hidden_states=rounded(sample["hidden_states"], self.dtype))
        return sample

    def delete(self, handle: str) -> None:
        self.inner.delete(handle)


def rounded(states: torch.Tensor, dtype: str) -> torch.Tensor:
    """The states a kept row of this dtype gives back when read (fp8: speculators' fp8 reader's bfloat16)."""
    stored = stored_tensors(states, dtype)
    if dtype == "fp8":
        from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor

        return dequantize_fp8_tensor(stored["hidden_states"], stored[SCALES_KEY], dtype=torch.bfloat16)
    return stored["hidden_states"]


@contextlib.contextmanager
def from_engine(stream: dict | None):
    """speculators' training loaders, asking the engine serving stream["served_name"] for missing states, rounded
    to stream["dtype"] (None: no change)."""
    if stream is None:
        yield
        return
    served_name, dtype = stream["served_name"], stream["dtype"]
    import speculators.train.cli as cli

    make_loaders = cli.create_train_val_loaders

    def loaders(**kw):
        kw["verifier_name_or_path"] = served_name
        kw["transfer"] = StoredDtypeTransfer(kw["transfer"], dtype)
        return make_loaders(**kw)

    cli.create_train_val_loaders = loaders
    try:
        yield
    finally:
        cli.create_train_val_loaders = make_loaders


def requests_served(endpoint: str) -> int | None:
    """The engine's finished requests so far (vLLM's `vllm:request_success_total`, all reasons), to count the
    verifier forward passes a training run asked for; None when its metrics do not answer."""
    import httpx

    try:
        text = httpx.get(f"{endpoint}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    counts = re.findall(r"^vllm:request_success_total\{[^}]*\}\s+([0-9.e+]+)$", text, flags=re.M)
    return int(sum(float(c) for c in counts)) if counts else None
