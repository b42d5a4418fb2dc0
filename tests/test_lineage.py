"""What keeps a draft from being measured on prompts it trained on: each draft's lineage (the prompts it and its
warm-start ancestors trained on), the warm-start decision against a run's held-out prompts, and a promotion that
never rests on a figure measured on other prompts. The whole flow's side is in tests/test_flow_e2e.py (nightly)."""

from __future__ import annotations

import json
from pathlib import Path

from eaglet.data import prompt_digests, write_conversations
from eaglet.report.history import decide
from eaglet.train.lineage import read_lineage, write_lineage
from eaglet.train.warm_start import warm_start_decision


def _conversations(path: Path, prompts: list[str]) -> Path:
    write_conversations(path, [[{"role": "user", "content": p}, {"role": "assistant", "content": "ok"}]
                               for p in prompts])
    return path


def _draft(root: Path, name: str, prompts: list[str], init: Path | None = None) -> Path:
    d = root / name
    d.mkdir()
    write_lineage(d, _conversations(root / f"{name}.jsonl", prompts), init)
    return d


def test_lineage_carries_every_ancestor_and_refuses_a_warm_start_that_saw_held_out_prompts(tmp_path):
    cold = _draft(tmp_path, "cold", ["a", "b", "c"])
    night = _draft(tmp_path, "night", ["d"], init=cold)
    lineage = read_lineage(night)
    assert lineage["known"] and lineage["drafts"] == ["cold"]
    assert set(lineage["prompts"]) == prompt_digests(tmp_path / "cold.jsonl") | prompt_digests(tmp_path / "night.jsonl")

    held = prompt_digests(_conversations(tmp_path / "held.jsonl", ["x", "y", "b"]))  # 'b': the cold draft's
    refused = warm_start_decision(night, held, explicit=False)
    assert refused["from"] is None and refused["held_out_seen"] == 1
    assert "trained on 1 of this run's 3 held-out prompts" in refused["reason"]

    clean = prompt_digests(_conversations(tmp_path / "clean.jsonl", ["x", "y"]))
    ok = warm_start_decision(night, clean, explicit=False)
    assert ok["from"] == str(night) and ok["held_out_seen"] == 0 and "none of the 2 held-out prompts" in ok["reason"]


def test_a_draft_without_lineage_is_refused_when_found_and_unknown_when_named(tmp_path):
    old = tmp_path / "old"  # a stored draft from before lineages, or one made elsewhere
    old.mkdir()
    held = prompt_digests(_conversations(tmp_path / "held.jsonl", ["x"]))
    found = warm_start_decision(old, held, explicit=False)
    assert found["from"] is None and "no complete lineage" in found["reason"]
    named = warm_start_decision(old, held, explicit=True)
    assert named["from"] == str(old) and named["held_out_seen"] is None
    child = _draft(tmp_path, "child", ["z"], init=old)  # its lineage is unknown too, so it is never found clean
    assert not read_lineage(child)["known"]
    assert warm_start_decision(child, held, explicit=False)["from"] is None
    assert warm_start_decision(None, held, explicit=False)["reason"].endswith("training from scratch")


def test_promotion_never_rests_on_a_figure_from_other_prompts(tmp_path):
    current = tmp_path / "drafts" / "old"
    current.mkdir(parents=True)
    (current / "report.json").write_text(json.dumps({"smoke": {"mean_acceptance_length": 1.2, "lossless": True},
                                                     "comparison": "prompts-A"}))
    (tmp_path / "current").symlink_to(Path("drafts") / "old")
    smoke = {"mean_acceptance_length": 1.8, "lossless": True}
    other = decide(tmp_path, "new", smoke, "prompts-B", None)
    assert not other["promoted"] and other["delta"] is None and "do not compare" in other["reason"]
    same = decide(tmp_path, "new", smoke, "prompts-A", None)
    assert same["promoted"] and same["delta"] == 0.6
