"""Is the draft worth serving, on the tiny verifier: the flow's evaluation (acceptance per suite and category,
lossless, the concurrency sweep per k under vLLM's serving benchmark, the k to serve, the plot), the gate at the
target concurrency, and `eaglet eval` with two drafts side by side.

Every run here reuses e2e_run's artifacts (data, states, the draft): the flow's reruns only evaluate, and the
verifier-alone figures are measured once for all of them."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from eaglet.data import prompt_part
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e

LEVELS = [1, 16]  # batch 1, and a level where the tiny draft's extra forwards cost more than they save


def _suites(tmp: Path, e2e_run) -> list[str]:
    """Two user suites: the demo's held-out prompts in two categories each, and one prompt the draft trained on
    (reported and left out)."""
    held = [json.loads(line) for line in Path("data/eval.jsonl").read_text().splitlines()]
    rows = (json.loads(line) for line in (Path(e2e_run["report"]["artifacts"]["data"]) / "train.jsonl").open())
    trained = next(p[0]["content"] for p in (prompt_part(r["messages"]) for r in rows)
                   if len(p) == 1 and p[0]["role"] == "user")
    a, b = tmp / "chat.jsonl", tmp / "code-math.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in held if r["category"] in ("writing", "explanation")))
    b.write_text(json.dumps({"prompt": trained, "category": "code"}) + "\n"  # first: inside the 6 kept
                 + "".join(json.dumps(r) + "\n" for r in held if r["category"] in ("code", "math")))
    return [str(a), str(b)]


@pytest.fixture(scope="session")
def eval_sets(e2e_run, session_dir) -> list[str]:
    tmp = session_dir / "suites"
    tmp.mkdir(exist_ok=True)
    return [f"--set=eval.suites=[{', '.join(_suites(tmp, e2e_run))}]", "--set=eval.enabled=true",
            "--set=eval.prompts_per_suite=6", "--set=eval.max_tokens=48", f"--set=eval.concurrency={LEVELS}",
            "--set=eval.k=[1, 3]"]


@pytest.fixture(scope="session")
def evaluated(e2e_run, eval_sets, session_dir) -> dict:
    out = session_dir / "evaluated"
    proc = run_cli(["run", *e2e_run["sets"], *eval_sets, "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"out": out, "report": json.loads((out / "report.json").read_text())}


def test_the_report_says_where_the_draft_pays(evaluated, e2e_run):
    r = evaluated["report"]
    e = r["evaluation"]
    assert r["tasks"]["verifier-serving"]["state"] == "Completed" and r["tasks"]["evaluate-draft"]["state"] == "Completed"
    assert r["tasks"]["train-draft"]["state"] == "Cached"  # e2e_run's draft, evaluated
    assert r["engine_loads"]["evaluation"] == 1 + 2  # the verifier alone, then one server per k
    # the smoke test rode on the k=3 server: no engine of its own, and the figures of e2e_run's own-engine smoke test
    own, folded = e2e_run["report"]["smoke"], r["smoke"]
    assert r["engine_loads"]["smoke"] == 0 and folded["engine"] == "evaluation" and r["tasks"]["smoke-test"]["state"] == "Completed"
    assert folded["lossless"] and folded["num_prompts"] == own["num_prompts"] and folded["drafts"] > 0
    assert folded["mean_acceptance_length"] == pytest.approx(own["mean_acceptance_length"], abs=0.05)
    assert {s["suite"] for s in e["suites"]} == {"chat", "code-math"}
    code = next(s for s in e["suites"] if s["suite"] == "code-math")
    assert code["left_out"] == 1  # the prompt the draft trained on is reported, not measured
    assert {(c["suite"], c["category"]) for c in e["categories"]} == {
        ("chat", "writing"), ("chat", "explanation"), ("code-math", "code"), ("code-math", "math")}
    for g in e["suites"] + e["categories"]:
        assert g["lossless"] and g["drafts"] > 0 and 1.0 <= g["mean_acceptance_length"] <= 4.0
        assert g["mean_acceptance_length"] == pytest.approx(1 + sum(g["per_position"]), abs=1e-6)
    for s in e["suites"]:  # every shorter chain's acceptance, read from the k=3 server's per-position rates
        assert len(s["acceptance_by_k"]) == 3 and s["acceptance_by_k"][-1] == pytest.approx(s["mean_acceptance_length"])
    assert sum(c["prompts"] for c in e["categories"]) == sum(s["prompts"] for s in e["suites"]) == 12 - 1
    assert {(row["k"], row["concurrency"]) for row in e["sweep"]} == {(k, c) for k in (1, 3) for c in LEVELS}
    for row in e["sweep"]:
        assert row["failed"] == 0 and row["output_tokens_per_s"] > 0 and row["speedup"] > 0
        assert row["ttft_ms_p50"] <= row["ttft_ms_p99"] and row["tpot_ms_p50"] <= row["tpot_ms_p99"]
    assert set(e["best"]) == {str(c) for c in LEVELS}
    assert e["speculative_config"]["model"] == r["draft_dir"] and e["speculative_config"]["method"] == "eagle3"
    assert e["speculative_config"]["num_speculative_tokens"] == e["best"]["1"]["k"]
    md = (evaluated["out"] / "report.md").read_text()
    assert "## Is it worth serving" in md and r["payoff"] in md and "--speculative-config" in md
    assert (evaluated["out"] / "serving.png").stat().st_size > 10_000
    assert r["promotion"]["promoted"]  # no target concurrency: promotion on acceptance, as before


def test_gate_refuses_a_draft_slower_at_the_target_and_passes_it_where_it_is_faster(e2e_run, eval_sets, session_dir):
    """The draft served at k=3 (its own server; at k=1 the tiny draft still pays at 16, so the best k would pass
    there): faster than the verifier alone at batch 1, slower at 16. Refused where it is slower, passed where it is
    faster, on the same measured figures."""
    out, sets = session_dir / "gated", [*e2e_run["sets"], *eval_sets, "--set=eval.k=[3]"]
    refused = run_cli(["run", *sets, "--set=eval.target_concurrency=16", "--output-dir", str(out)])
    r = json.loads((out / "report.json").read_text())
    at_k3 = {row["concurrency"]: row["speedup"] for row in r["evaluation"]["sweep"]}
    assert at_k3[1] > 1.0 > at_k3[16], f"the tiny draft at k=3 should win at batch 1 and lose at 16 here: {at_k3}"
    assert refused.returncode != 0
    assert "quality gate: at the target concurrency 16" in refused.stdout + refused.stderr
    assert not r["promotion"]["promoted"] and r["gate_failure"].startswith("at the target concurrency 16")
    assert r["tasks"]["verifier-serving"]["state"] == "Cached"  # the verifier alone is measured once
    passed = run_cli(["run", *sets, "--set=eval.target_concurrency=1", "--output-dir", str(out)])
    assert passed.returncode == 0, passed.stdout[-3000:] + passed.stderr[-3000:]
    r = json.loads((out / "report.json").read_text())
    assert r["tasks"]["evaluate-draft"]["state"] == "Cached"  # a new target re-judges the same figures
    assert r["promotion"]["promoted"] and r["gate_failure"] is None
    assert r["evaluation"]["speculative_config"]["num_speculative_tokens"] == 3 and r["evaluation"]["serve_at"] == 1


def test_eaglet_eval_compares_two_drafts(e2e_run, tiny_verifier, eval_sets, session_dir):
    """The trained draft against the same draft with its layer weights scrambled: one table, JSON and Markdown."""
    trained = e2e_run["out"] / "draft"
    scrambled = session_dir / "scrambled"
    shutil.copytree(trained, scrambled, dirs_exist_ok=True)
    weights = scrambled / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: (v.flip(0) if k.endswith("fc.weight") else v) for k, v in tensors.items()}, weights,
              metadata={"format": "pt"})
    out = session_dir / "compare"
    sets = [s for s in eval_sets if "eval.k=" not in s]
    proc = run_cli(["eval", "--verifier", str(tiny_verifier), "--draft", f"trained={trained}",
                    "--draft", f"scrambled={scrambled}", "--set=eval.k=[3]", *sets, "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads((out / "comparison.json").read_text())
    rows = {r["draft"]: r for r in table["rows"]}
    assert set(rows) == {"trained", "scrambled"} and all(r["lossless"] for r in rows.values())
    for suite in ("chat", "code-math"):
        assert rows["trained"][f"acceptance {suite}"] > rows["scrambled"][f"acceptance {suite}"]
    md = (out / "comparison.md").read_text()
    assert "| trained |" in md and "| scrambled |" in md and "speedup c=1" in md
