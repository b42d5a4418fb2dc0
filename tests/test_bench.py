"""The benchmark harness, once, on the tiny verifier with minimal sizes: every row is filled with its repeats
(min / median / max), start-up is itemised, and the decoding invariants hold (no tolerance). No timing
assertions: the numbers are meaningless at this size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def test_bench_fills_every_row(tiny_verifier, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--preset", "tiny", "--verifier", str(tiny_verifier),
                           "--name", "tiny", "--out", str(tmp_path / "results"), "--work-dir", str(tmp_path / "work")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [result_file] = (tmp_path / "results").glob("*-tiny.json")
    r = json.loads(result_file.read_text())
    md = result_file.with_suffix(".md").read_text()

    dp, ex, tr, tl = r["data_pass"], r["extraction"], r["training"], r["training_realistic"]
    o, d, s = r["orchestration"], r["decoding"], r["storage"]
    from bench.run import _slug

    assert r["cores"] and result_file.name == f"{r['date']}-{_slug(r['cpu_model'])}-tiny.json"  # per machine, date
    # every ratio row: repeats, sides interleaved, min <= median <= max
    for row in (dp["steady"], dp["whole"], ex["steady"], tr["steady"], tr["whole"]):
        for side in ("pipeline", "limit", "ratio"):
            assert row[side]["n"] == 2 and 0 < row[side]["min"] <= row[side]["median"] <= row[side]["max"], row
    assert len(dp["pipeline"]) == len(dp["bare"]) == 2 and dp["requests"] > 0
    assert all(p["generated_tokens"] > 0 and p["startup_s"] > 0 for p in dp["pipeline"] + dp["bare"])
    assert dp["startup"]["items"]["pipeline"]["engine start (server up)"] > 0
    assert dp["startup"]["items"]["limit"]["engine start (server up)"] > 0
    assert len(tr["pipeline"]) == len(tr["direct"]) == 2 and tr["window_steps"] > 0
    items = tr["startup"]["items"]
    for name in ("speculators set-up (model, verifier weights, data)", "checkpoint saves", "validation"):
        assert name in items["pipeline"] and name in items["limit"], name
    for name in ("final bf16 draft", "store: manifest (sha256 of every file) + rename", "Prefect task start + cache key"):
        assert name in items["pipeline"], name
    assert len(tl["pipeline"]) == len(tl["direct"]) == 1 and tl["epochs"] == 2 and tl["tokens"] == 2 * tr["tokens"]
    assert o["cold_s"] > 0 and len(o["cached_s"]) == 2
    assert o["cached_states"] == ["Cached"]  # every content-keyed task was a cache hit
    changed = o["training_change_states"]
    assert changed["generate-and-capture"] == "Cached" and changed["train-draft"] == "Completed"
    assert "load-verifier" not in changed  # a cached data pass starts no engine
    assert all(o["memory"][t] for t in ("load-verifier", "generate-and-capture", "train-draft"))
    assert [k["k"] for k in d["k"]] == [1, 2]
    for k in d["k"]:
        assert 1.0 <= k["mean_acceptance_length"] <= k["k"] + 1
        assert len(k["acceptance_per_position"]) == k["k"]
        assert k["tokens_per_s_batched"] > 0
    [b1] = d["batch1"]["rows"]
    assert b1["k"] == 1 and len(b1["speedups"]) == len(b1["acceptance_lengths"]) == 2
    assert all(1.0 <= a <= 2.0 for a in b1["acceptance_lengths"]) and b1["identical_outputs"]
    assert s["bf16"]["nominal"] == (3 + 1) * 128 * 2  # 3 aux layers + the last, hidden 128
    assert s["fp8"]["on_disk"] < s["bf16"]["on_disk"]
    assert r["checks"] == []  # includes: no batch-1 speedup above its acceptance length, no tolerance
    for heading in ("data pass (", "training (1 epoch", "extraction, hf backend", "training start-up",
                    "data pass start-up", "fully cached rerun", "k=2", "decoding, batch 1", "fp8", "train-draft",
                    "checks: all passed"):
        assert heading in md, heading
