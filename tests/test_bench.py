"""The benchmark harness, once, on the tiny verifier with minimal sizes: every row is filled and the decoding
invariants hold. No timing assertions: the numbers are meaningless at this size."""

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

    ex, tr, o, d, s = r["extraction"], r["training"], r["orchestration"], r["decoding"], r["storage"]
    assert len(ex["pipeline_tokens_per_s"]) == len(ex["bare_tokens_per_s"]) == 2 and ex["ratio"] > 0
    assert len(tr["pipeline_s"]) == len(tr["direct_s"]) == 2 and tr["ratio"] > 0
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
        assert k["tokens_per_s_batched"] > 0 and k["tokens_per_s_batch1"] > 0
    assert s["bf16"]["nominal"] == (3 + 1) * 128 * 2  # 3 aux layers + the last, hidden 128
    assert s["fp8"]["on_disk"] < s["bf16"]["on_disk"]
    assert r["checks"] == []
    for heading in ("extraction, tokens/s", "training, tokens/s", "fully cached rerun", "k=2", "fp8",
                    "train-draft", "checks: all passed"):
        assert heading in md, heading
