"""The benchmark harness, once, on the tiny verifier with the `check` preset (bench/run.py: the smallest sizes that
still exercise every code path, one repeat, one k, no training-only change run (test_dflash's dflash
rerun checks what it would), the batched decoding rows on the batch-1 pair's engines, the
realistic-length training row from the comparison's pair): every row is filled (min / median / max of its one
repeat), start-up is itemised, and the decoding invariants hold (no tolerance). No timing assertions: the numbers
are meaningless at this size. The step clock's arithmetic over several epochs (the `full` and `tiny` presets'
realistic-length pair) is checked exactly on synthetic events."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.e2e
def test_bench_fills_every_row(tiny_verifier, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--preset", "check", "--verifier", str(tiny_verifier),
                           "--name", "check", "--out", str(tmp_path / "results"), "--work-dir", str(tmp_path / "work")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [result_file] = (tmp_path / "results").glob("*-check.json")
    r = json.loads(result_file.read_text())
    md = result_file.with_suffix(".md").read_text()

    dp, ex, tr, tl = r["data_pass"], r["extraction"], r["training"], r["training_realistic"]
    o, d, s = r["orchestration"], r["decoding"], r["storage"]
    from bench.run import PRESETS, _slug

    repeats = PRESETS["check"]["repeats"]
    assert r["cores"] and result_file.name == f"{r['date']}-{_slug(r['cpu_model'])}-check.json"  # per machine, date
    # every ratio row: its repeats (one here), min <= median <= max
    for row in (dp["steady"], dp["whole"], ex["steady"], tr["steady"], tr["whole"], tl["steady"], tl["whole"]):
        for side in ("pipeline", "limit", "ratio"):
            assert row[side]["n"] == repeats and 0 < row[side]["min"] <= row[side]["median"] <= row[side]["max"], row
    assert len(dp["pipeline"]) == len(dp["bare"]) == repeats and dp["requests"] > 0
    assert all(p["generated_tokens"] > 0 and p["startup_s"] > 0 for p in dp["pipeline"] + dp["bare"])
    assert dp["startup"]["items"]["pipeline"]["engine start (server up)"] > 0
    assert dp["startup"]["items"]["limit"]["engine start (server up)"] > 0
    assert len(ex["pipeline_tokens_per_s"]) == len(ex["bare_tokens_per_s"]) == repeats and ex["tokens"] > 0
    assert len(tr["pipeline"]) == len(tr["direct"]) == repeats and tr["window_steps"] > 0
    items = tr["startup"]["items"]
    for name in ("speculators set-up (model, verifier weights, data)", "checkpoint saves", "validation"):
        assert name in items["pipeline"] and name in items["limit"], name
    for name in ("final bf16 draft", "store: manifest (sha256 of every file) + rename", "Prefect task start + cache key"):
        assert name in items["pipeline"], name
    # the realistic-length pair at the run's own epoch: the comparison's first pair, summarised as its own row
    assert PRESETS["check"]["realistic_epochs"] == tl["epochs"] == tr["epochs"] == 1
    assert tl["pipeline"] == tr["pipeline"][:1] and tl["direct"] == tr["direct"][:1] and tl["tokens"] == tr["tokens"]
    assert tl["reused"] == "the comparison's first pair"
    assert o["cold_s"] > 0 and len(o["cached_s"]) == repeats
    assert o["cached_states"] == ["Cached"]  # every content-keyed task was a cache hit
    assert o["training_change"] is None and "training_change_s" not in o  # the check preset skips that run
    assert all(o["memory"][t] for t in ("load-verifier", "generate-and-capture", "train-draft"))
    # batched rows: one k, on the batch-1 pair's engines (the check preset's reuse)
    assert [k["k"] for k in d["k"]] == [1] and d["batched_engines"] == "the batch-1 pair's"
    assert d["baseline_tokens_per_s_batched"] > 0 and d["baseline_seconds_batched"] > 0
    for k in d["k"]:
        assert 1.0 <= k["mean_acceptance_length"] <= k["k"] + 1
        assert len(k["acceptance_per_position"]) == k["k"]
        assert k["drafts"] > 0 and k["tokens_per_s_batched"] > 0  # the draft ran
        assert k["identical_outputs"]  # float32: the draft changes no token
    [b1] = d["batch1"]["rows"]
    assert b1["k"] == 1 and len(b1["speedups"]) == len(b1["acceptance_lengths"]) == repeats
    assert all(1.0 <= a <= 2.0 for a in b1["acceptance_lengths"]) and b1["identical_outputs"]
    assert len(b1["drafts"]) == repeats and all(n > 0 for n in b1["drafts"])
    assert s["bf16"]["nominal"] == (3 + 1) * 128 * 2  # 3 aux layers + the last, hidden 128
    assert s["fp8"]["on_disk"] < s["bf16"]["on_disk"]
    assert r["checks"] == []  # includes: no batch-1 speedup above its acceptance length, no tolerance
    for heading in ("data pass (", "training (1 epoch", "training, 1 epoch (one pair", "extraction, hf backend",
                    "training start-up", "data pass start-up", "fully cached rerun",
                    "on the batch-1 pair's two engines", "| k=1 |", "decoding, batch 1", "fp8", "train-draft",
                    "checks: all passed"):
        assert heading in md, heading


def test_step_clock_over_two_epochs():
    """bench.steps.profile on a run of 2 epochs of 3 steps (100 tokens each), one warm-up step: the steady window
    is epoch 1's steps 2-3 and epoch 2's steps 2-3 (a later epoch's first step holds the epoch's start), and every
    second the window does not explain is an item of start-up."""
    from bench.steps import profile

    ev = [["speculators main", 1.0, 20.0, None], ["epoch", 2.0, 8.0, None], ["epoch", 9.0, 15.0, None],
          ["validation", 15.0, 17.0, None], ["checkpoint save", 17.0, 18.0, None]]
    for end in (4.0, 6.0, 8.0, 11.0, 13.0, 15.0):
        ev += [["batch", end - 1.5, None, 100], ["step", end - 0.5, end, None]]
    p = profile({"events": ev, "t0": 0.0, "t1": 21.0}, warm_steps=1)
    assert (p["steps"], p["window_steps"], p["tokens"], p["seconds"]) == (6, 4, 600, 21.0)
    assert p["steady_tokens_per_s"] == 400 / 8.0  # 4 steps of 2 s
    assert p["startup_s"] == 21.0 - 600 / 50.0
    items = p["startup_items"]
    assert items == {"before speculators main": 1.0, "speculators set-up (model, verifier weights, data)": 1.0,
                     "first 1 steps beyond steady rate": 0.0, "validation": 2.0, "checkpoint saves": 1.0,
                     "speculators after the last step": 2.0, "after speculators main": 1.0,
                     "unaccounted": 21.0 - 12.0 - 8.0}
    with pytest.raises(RuntimeError, match="no steady-state steps"):
        profile({"events": ev[:5] + ev[5:7], "t0": 0.0, "t1": 21.0}, warm_steps=1)  # one step: nothing steady
