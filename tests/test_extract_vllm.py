"""The vllm extraction backend (vLLM's extract_hidden_states method + hidden-states connector) against the hf
backend on the same tokens, run for real on vLLM's CPU backend; and the backend checks made before any load."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglet.errors import EagletError
from eaglet.extract import extract_hidden_states, resolve_backend
from eaglet.train import visible_accelerators
from eaglet.store import file_sha256
from tests.conftest import write_echo_conversations

AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return write_echo_conversations(tmp_path_factory.mktemp("vx") / "c.jsonl", 24)


def _extract(verifier, conversations, out, **kw) -> dict:
    out.mkdir(exist_ok=True)
    return extract_hidden_states(str(verifier), conversations, out, AUX, 128, batch_size=4, **kw)


def _files(path) -> dict[str, str]:
    return {str(f.relative_to(path)): file_sha256(f) for f in sorted(path.rglob("*")) if f.is_file()}


def _vllm_processes() -> list[str]:
    """vLLM's engine processes still alive (not zombies), after a few seconds for SIGKILL to land."""
    for _ in range(10):
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:
                continue
            name, state = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2]
            if name.startswith("VLLM::") and state != "Z":
                alive.append(f"{name} {state}")
        if not alive:
            return []
        time.sleep(0.5)
    return alive


class Crash(Exception):
    pass


def _crash_when_all_written(done, total, _tokens_per_s):
    if done == total:
        raise Crash  # as if killed after the last shard's record, before the artifact was finished


@pytest.fixture(scope="module")
def both(tiny_verifier, conversations, tmp_path_factory):
    """hf; and vllm interrupted, shard 2 then marked unfinished, and resumed (vLLM recomputes shard 2 alone)."""
    base = tmp_path_factory.mktemp("backends")
    hf = _extract(tiny_verifier, conversations, base / "hf", backend="hf")
    work = base / "vllm"
    with pytest.raises(Crash):
        _extract(tiny_verifier, conversations, work, backend="vllm", progress=_crash_when_all_written)
    assert _vllm_processes() == [], "vLLM's engine processes outlived the interrupted extraction"
    records = work / "hidden_states" / ".shards"
    assert sorted(r.name for r in records.glob("*.json")) == [f"{n}.json" for n in range(6)]
    first = json.loads((records / "2.json").read_text())["files"]
    (records / "2.json").unlink()
    vllm = _extract(tiny_verifier, conversations, work, backend="vllm")
    return base, hf, vllm, first


def test_vllm_backend_writes_the_hf_layout_with_the_same_states(both):
    base, hf, vllm, _ = both
    assert (hf["backend"], vllm["backend"]) == ("hf", "vllm")
    assert vllm["shards"] == hf["shards"] == 6 and vllm["samples"] == hf["samples"] == 24
    a, b = _files(base / "hf"), _files(base / "vllm")
    assert a.keys() == b.keys()  # no connector scratch files or shard records left behind
    for name in a:  # the dataset and the token counts are the same bytes
        if not name.startswith("hidden_states/"):
            assert a[name] == b[name], name
    worst = 1.0
    for name in (n for n in a if n.startswith("hidden_states/hs_")):
        x, y = load_file(base / "hf" / name), load_file(base / "vllm" / name)
        assert torch.equal(x["token_ids"], y["token_ids"])
        assert x["hidden_states"].shape == y["hidden_states"].shape  # [T, 3 aux + last, H]
        assert x["hidden_states"].shape[1] == len(AUX) + 1 and x["hidden_states"].dtype == y["hidden_states"].dtype
        hx, hy = x["hidden_states"].float(), y["hidden_states"].float()
        # same layers (a wrong layer id gives cosines far below 0.99), differing by bf16 rounding
        worst = min(worst, torch.nn.functional.cosine_similarity(hx, hy, dim=-1).min().item())
        rel = ((hx - hy).norm(dim=-1) / hx.norm(dim=-1)).max().item()
        assert rel < 0.02, (name, rel)
    assert worst > 0.9995, worst


def test_vllm_backend_resumes_from_shard_records(both):
    base, _, vllm, first = both
    assert vllm["resumed_shards"] == 5  # only the shard without a record was given to vLLM again
    assert 0 < vllm["extracted_tokens"] < vllm["tokens"]
    again = {name: file_sha256(base / "vllm" / "hidden_states" / name) for name in first}
    assert again == first  # recomputed alone in a new engine, the shard's files are the same bytes


@pytest.mark.skipif(visible_accelerators() > 0, reason="the checks of a machine without a GPU")
def test_backend_checks_before_any_load():
    assert resolve_backend("auto") == "hf"  # no GPU
    assert resolve_backend("vllm") == "vllm"  # vLLM's CPU backend
    for kwargs, words in [
        (dict(backend="vllm", workers=2), "workers and scheduler_address"),
        (dict(backend="vllm", scheduler="tcp://10.0.0.5:8786"), "workers and scheduler_address"),
        (dict(backend="vllm", tensor_parallel_size=2), "needs that many GPUs; 0 visible"),
        (dict(backend="hf", tensor_parallel_size=8), "applies to the vllm backend"),
        (dict(backend="auto", device="cuda:1"), "no CUDA device is visible"),
    ]:
        with pytest.raises(EagletError, match=words):
            resolve_backend(**kwargs)
