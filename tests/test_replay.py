"""A warm start's replay: the rows its lineage never saw, plus a fixed fraction of the seen ones, as a view of links
that speculators reads like any other; seen rows found from the lineage or, for older drafts, the manifest chain."""

import json

import torch

from eaglet import store
from eaglet.capture.rows import publish_row, view_rows
from eaglet.train.lineage import seen_rows, write_lineage
from eaglet.train.replay import replayed, training_view
from eaglet.train.warm_start import run_training
from eaglet.config import TrainingParams


def _row(key: str, n: int = 4) -> str:
    publish_row(key, [{"input_ids": list(range(n)), "loss_mask": [0, 1, 1, 1][:n],
                       "hidden_states": torch.zeros(n, 4, 8)}], "bfloat16")
    return key


def _view(name: str, keys: list[str]):
    from eaglet.capture.rows import assemble

    return store.publish("hidden_states", name, lambda w: assemble(w, keys, set()) and None,
                         inputs={"links": {"rows": keys}})


def test_replay_keeps_new_rows_and_a_fixed_share_of_seen_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_HOME", str(tmp_path / "store"))
    old = [_row(f"{i:016x}") for i in range(40)]
    new = [_row(f"{i + 100:016x}") for i in range(8)]
    cold_states = _view("cold", old)
    grown = _view("grown", old + new)
    # a draft trained before lineages kept rows: found through its manifest (states it trained on)
    cold = store.publish("draft_ckpt", "c0", lambda w: None, inputs={"states": cold_states.name, "init": None})
    assert seen_rows(cold) == set(old)
    view = training_view(grown, cold, 0.25, tmp_path / "view")
    chosen = view_rows(tmp_path / "view")["rows"]
    assert set(new) <= set(chosen) and view["new"] == 8
    assert view["replayed"] == sum(replayed(k, 0.25) for k in old) and 0 < view["replayed"] < 40
    assert chosen == [k for k in old + new if k in new or replayed(k, 0.25)]  # order kept, same choice each time
    assert (tmp_path / "view" / "hidden_states" / "hs_0.safetensors").is_symlink()
    assert training_view(grown, cold, 1.0, tmp_path / "all") is None  # every row: the states view itself


def test_lineage_rows_accumulate_and_levers_apply_only_to_warm_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_HOME", str(tmp_path / "store"))
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    first = tmp_path / "d1"
    first.mkdir()
    write_lineage(first, train, None, ["a", "b"])
    second = tmp_path / "d2"
    second.mkdir()
    assert write_lineage(second, train, first, ["b", "c"])["rows"] == ["a", "b", "c"]
    assert seen_rows(second) == {"a", "b", "c"}
    t = TrainingParams(lr=2e-3, warm_epochs=1, warm_lr_fraction=0.25, warm_warmup_steps=0)
    assert run_training(None, t) == t
    warm = run_training("/some/draft", t)
    assert (warm.epochs, warm.lr, warm.warmup_steps) == (1, 5e-4, 0)
