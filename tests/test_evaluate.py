"""The evaluation's inputs and decisions, without an engine: the built-in suites read from their packages, user
suites, the checks `eaglet run` makes before any load, and what the figures decide (speedup, best k, crossover,
the gate)."""

import json

import pytest

from deployments.cli import main
from eaglet.config import load_config
from eaglet.errors import EagletError
from eaglet.evaluate import serving
from eaglet.evaluate.suites import BUILTIN, load_suite, load_suites
from eaglet.report import _evaluation_lines, evaluation_tables
from eaglet.report.history import decide


@pytest.mark.parametrize("name, size, categories", [
    ("mt-bench", 80, {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}),
    ("humaneval", 164, {"python"}),
    ("math", 374, {"MATH500", "AIME2024", "AIME2025", "CNMO"}),
])
def test_builtin_suites_come_from_their_packages(name, size, categories):
    s = load_suite(name)
    assert len(s.prompts) == size and set(s.categories) == categories
    assert BUILTIN[name].package in s.source and all(p.prompt.strip() for p in s.prompts)


def test_a_cut_suite_keeps_every_category():
    (s,) = load_suites(["mt-bench"], 16)
    assert len(s.prompts) == 16 and len(s.categories) == 8


def test_user_suite_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"prompt": "a", "category": "x"}) + "\n\n"
                 + json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}]})
                 + "\n")
    s = load_suite(str(f))
    assert s.name == "mine" and [(p.prompt, p.category) for p in s.prompts] == [("a", "x"), ("b", "all")]


@pytest.mark.parametrize("set_, message", [
    ("eval.suites=[nope]", "unknown suite 'nope'"),
    ("eval.suites=[EMPTY]", "has no prompts"),
    ("eval.suites=[/no/such.jsonl]", "does not exist"),
    ("eval.suites=[humaneval, humaneval]", "names humaneval twice"),
    ("eval.concurrency=[0, 4]", "eval.concurrency.0: Input should be greater than or equal to 1"),
    ("eval.k=[2, 4]", "k=4, above the trained k=3"),
    ("eval.target_concurrency=8", "not among eval.concurrency"),
])
def test_eaglet_run_refuses_before_any_load(set_, message, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    sets = [set_.replace("EMPTY", str(empty)), "eval.concurrency=[1, 4]" if "target" in set_ else "eval.enabled=true"]
    rc = main(["run", *[f"--set={s}" for s in sets], "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("eaglet: error:") and message in err[0]
    assert not (tmp_path / "out").exists()


def test_levels_always_measure_the_target():
    cfg = load_config(None, ["eval.target_concurrency=2"])
    assert serving.levels(cfg, on_gpu=False) == [1, 2, 8]
    assert serving.levels(cfg, on_gpu=True) == [1, 2, 8, 32, 128]
    assert serving.k_values(load_config(None, []), 3, on_gpu=True) == [1, 2, 3]
    assert serving.k_values(load_config(None, []), 3, on_gpu=False) == [3]  # one server start on a CPU host
    assert serving.k_values(load_config(None, ["eval.k=[1, 3]"]), 3, on_gpu=False) == [1, 3]


def test_acceptance_of_shorter_chains_from_per_position_rates():
    assert serving.acceptance_by_k([0.5, 0.25, 0.125]) == [1.5, 1.75, 1.875]
    assert serving.acceptance_by_k([]) == []


def _rows(alone: dict, draft: dict) -> tuple[list[dict], list[dict]]:
    base = [{"k": 0, "concurrency": c, "output_tokens_per_s": v} for c, v in alone.items()]
    rows = [{"k": k, "concurrency": c, "output_tokens_per_s": v} for (k, c), v in draft.items()]
    return rows, base


def test_payoff_best_k_and_crossover():
    rows, base = _rows({1: 60, 4: 150, 16: 400}, {(1, 1): 66, (3, 1): 84, (1, 4): 160, (3, 4): 140,
                                                  (1, 16): 300, (3, 16): 250})
    rows = serving.with_speedup(rows, base)
    p = serving.payoff(rows, "/d", "eagle3", target=None)
    assert p["best"]["1"] == {"k": 3, "speedup": 1.4} and p["best"]["4"]["k"] == 1
    assert p["pays_at"] == [1, 4] and p["crossover"] == 16
    assert p["serve_at"] == 1 and p["speculative_config"] == {"method": "eagle3", "model": "/d",
                                                              "num_speculative_tokens": 3}
    assert serving.payoff(rows, "/d", "eagle3", target=4)["speculative_config"]["num_speculative_tokens"] == 1


def _evaluation(speedups: dict[int, float]) -> dict:
    rows, base = _rows({c: 100.0 for c in speedups}, {(3, c): 100.0 * s for c, s in speedups.items()})
    rows = serving.with_speedup(rows, base)
    return {"method": "eagle3", "trained_k": 3, "k": [3], "levels": sorted(speedups), "sweep": rows,
            "verifier_alone": base, "machine": {"cpu": "a CPU", "gpus": ""}, "engine_loads": 1,
            "measured_at": "now", "suites": [], "categories": [], **serving.payoff(rows, "/d", "eagle3", None)}


def test_gate_refuses_a_draft_slower_at_the_target_and_passes_a_faster_one(tmp_path):
    e = _evaluation({1: 1.3, 16: 0.6})
    slower = serving.speedup_failure(e, target=16, min_speedup=1.0)
    assert slower and "target concurrency 16" in slower and "0.60x" in slower
    assert serving.speedup_failure(e, target=1, min_speedup=1.0) is None
    assert serving.speedup_failure(e, target=1, min_speedup=1.5) is not None
    assert serving.speedup_failure(e, target=None, min_speedup=1.0) is None  # no target: acceptance decides
    smoke = {"mean_acceptance_length": 2.0, "lossless": True}
    refused = decide(tmp_path, "d1", smoke, "c", slower)
    assert not refused["promoted"] and refused["reason"].startswith("not promoted: at the target concurrency 16")
    assert decide(tmp_path, "d1", smoke, "c", None)["promoted"]


def test_report_says_where_the_draft_pays():
    e = _evaluation({1: 1.3, 4: 1.1, 16: 0.6})
    assert serving.payoff_sentence(e) == ("on a CPU the draft pays at concurrency 1, 4 (best 1.30x at k=3, 1.10x at "
                                          "k=3); it costs at 16")
    assert "slower than the verifier alone at every concurrency" in serving.payoff_sentence(_evaluation({1: 0.9}))
    e["serve_at"] = 1
    text = "\n".join(_evaluation_lines(e, serving.payoff_sentence(e), {}, {"max_tokens": 64}))
    assert "from concurrency 16 no k pays" in text and '"num_speculative_tokens": 3' in text
    tables = evaluation_tables({"evaluation": e, "payoff": "p"})
    assert [r["concurrency"] for r in tables["serving-sweep"][0]] == [1, 1, 4, 4, 16, 16]


def test_comparison_table():
    a, b = _evaluation({1: 1.3, 16: 0.6}), _evaluation({1: 0.9, 16: 0.5})
    for e, al in ((a, 2.1), (b, 1.0)):
        e["suites"] = [{"suite": "s", "mean_acceptance_length": al, "lossless": True}]
    table = serving.compare({"trained": a, "scrambled": b})
    assert [r["draft"] for r in table["rows"]] == ["trained", "scrambled"]
    assert table["rows"][0]["acceptance s"] == 2.1 and table["rows"][0]["speedup c=1"] == "1.30x (k=3)"
    md = serving.comparison_markdown(table, "/v", {"cpu": "a CPU", "gpus": ""})
    assert md.count("\n| ") == 3 and "| trained | eagle3 |" in md


def test_eval_errors_are_user_errors():
    with pytest.raises(EagletError, match="above the trained k=2"):
        serving.k_values(load_config(None, ["eval.k=[3]"]), 2)
