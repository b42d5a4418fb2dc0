"""The converter: speculators <-> flat, the validator on every hazard, and conversions that never half-write.

The drafts here are speculators' own Eagle3DraftModel, initialised (not trained) for the tiny verifier: the
converter cares about names, shapes and configs, which are the same as a trained draft's.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglet.drafts.checkpoint import load_tensors
from eaglet.drafts.eagle3 import flat as flat_form
from eaglet.drafts.eagle3.flat import flatten, unflatten
from eaglet.drafts.eagle3.validate import validate
from eaglet.errors import EagletError
from tests.conftest import run_cli

DRAFT_VOCAB = 128


def make_nested_draft(verifier: Path, out: Path, **flags) -> Path:
    """A speculators checkpoint exactly as speculators writes one (save_pretrained of Eagle3DraftModel)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    layer = create_transformer_layer_config(str(verifier), num_layers=1, draft_arch="llama", hidden_act=None,
                                            sliding_window=2048, full_attention_indices=[0])
    selected = torch.arange(DRAFT_VOCAB) * 3  # any distinct verifier ids
    t2d = torch.zeros(layer.vocab_size, dtype=torch.bool)
    t2d[selected] = True
    torch.manual_seed(0)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=selected - torch.arange(DRAFT_VOCAB),
        verifier_name_or_path=str(verifier), draft_vocab_size=DRAFT_VOCAB, ttt_steps=3, draft_attn_impl="sdpa",
        **{"norm_before_residual": True, "norm_before_fc": True, "norm_output": True, **flags},
    )
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def nested(tiny_verifier, tmp_path_factory) -> Path:
    return make_nested_draft(tiny_verifier, tmp_path_factory.mktemp("convert") / "nested")


@pytest.fixture(scope="module")
def flat(nested, tiny_verifier) -> Path:
    out = nested.parent / "flat"
    flatten(nested, out, str(tiny_verifier))
    return out


def test_flat_config_and_weights(flat, nested, tiny_verifier):
    cfg = json.loads((flat / "config.json").read_text())
    vcfg = json.loads((tiny_verifier / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True and cfg["num_aux_hidden_states"] == 3
    assert cfg["head_dim"] == 64 and cfg["vocab_size"] == vcfg["vocab_size"] and cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["target_hidden_size"] == 128 and cfg["hidden_act"] == "silu"
    assert {f: cfg[f] for f in ("norm_before_residual", "norm_before_fc", "norm_output", "fc_norm")} == {
        "norm_before_residual": True, "norm_before_fc": True, "norm_output": True, "fc_norm": False}
    assert cfg["layer_types"] == ["full_attention"] and cfg["rope_theta"] == 10000.0
    assert json.loads((flat / "config_speculators.json").read_text()) == json.loads((nested / "config.json").read_text())
    flat_w, nested_w = load_tensors(flat), load_tensors(nested)
    assert "t2d" not in flat_w and "d2t" in flat_w
    assert "embed_tokens.weight" in nested_w and "embed_tokens.weight" not in flat_w  # identical to the verifier's
    for name, t in flat_w.items():
        assert torch.equal(t, nested_w[name]), name
    assert validate(flat, str(tiny_verifier)).problems == []


def test_midlayer_naming_serving_id_and_kept_embeddings(nested, tiny_verifier, tmp_path):
    out = tmp_path / "flat"
    flatten(nested, out, str(tiny_verifier), serving_id="acme/tiny-verifier", layer_prefix="midlayer",
            keep_embeddings=True)
    names = set(load_tensors(out))
    assert "midlayer.self_attn.q_proj.weight" in names and not any(n.startswith("layers.") for n in names)
    assert "embed_tokens.weight" in names
    original = json.loads((out / "config_speculators.json").read_text())
    assert original["speculators_config"]["verifier"]["name_or_path"] == "acme/tiny-verifier"
    assert validate(out, str(tiny_verifier)).problems == []


def test_flatten_unflatten_flatten_is_stable(flat, nested, tiny_verifier, tmp_path):
    from speculators.models.eagle3 import Eagle3DraftModel

    back = tmp_path / "nested-again"
    unflatten(flat, back, str(tiny_verifier))
    again = tmp_path / "flat-again"
    flatten(back, again, str(tiny_verifier))
    assert (again / "config.json").read_bytes() == (flat / "config.json").read_bytes()
    a, b = load_tensors(flat), load_tensors(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the unflattened checkpoint is one speculators can load (and so fine-tune), with the same vocab mapping
    assert torch.equal(load_tensors(back)["t2d"], load_tensors(nested)["t2d"])
    model = Eagle3DraftModel.from_pretrained(str(back))
    assert model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5] and model.config.norm_before_residual
    assert not model.embed_tokens.weight.isnan().any()  # filled from the verifier


# --- every hazard, built and named -----------------------------------------------------------------------------

def _set(d, key, value):
    d[key] = value


HAZARDS = {
    # name: (change to (config, tensors), text the validator must report)
    "missing tensor": (lambda c, t: t.pop("layers.0.hidden_norm.weight"), "missing tensor layers.0.hidden_norm.weight"),
    "unexpected bias": (lambda c, t: _set(t, "layers.0.self_attn.q_proj.bias", torch.zeros(128)),
                        "unexpected bias layers.0.self_attn.q_proj.bias: vLLM drops it silently"),
    "unknown tensor": (lambda c, t: _set(t, "model.fc.weight", t.pop("fc.weight")),
                       "unexpected tensor model.fc.weight"),
    "aux ids only nested": (lambda c, t: c.pop("eagle_aux_hidden_state_layer_ids"), "not at the top level"),
    "aux ids disagree": (lambda c, t: _set(c, "eagle_aux_hidden_state_layer_ids", [1, 4, 5]), "aux layer ids differ"),
    "aux ids duplicated": (lambda c, t: (_set(c, "eagle_aux_hidden_state_layer_ids", [2, 2, 5]),
                                         _set(c["eagle_config"], "eagle_aux_hidden_state_layer_ids", [2, 2, 5])),
                           "have duplicates"),
    "aux ids descending": (lambda c, t: (_set(c, "eagle_aux_hidden_state_layer_ids", [5, 4, 2]),
                                         _set(c["eagle_config"], "eagle_aux_hidden_state_layer_ids", [5, 4, 2])),
                           "not ascending"),
    "aux ids beyond verifier": (lambda c, t: (_set(c, "eagle_aux_hidden_state_layer_ids", [2, 4, 8]),
                                              _set(c["eagle_config"], "eagle_aux_hidden_state_layer_ids", [2, 4, 8])),
                                "outside the verifier's layers"),
    "aux count": (lambda c, t: _set(c, "num_aux_hidden_states", 2), "num_aux_hidden_states 2 != 3"),
    "aux states off": (lambda c, t: _set(c["eagle_config"], "use_aux_hidden_state", False), "use_aux_hidden_state"),
    "norm_before_residual defaulted": (lambda c, t: c.pop("norm_before_residual"),
                                       "norm_before_residual is missing, and vLLM's flat default is False"),
    "norm flag flipped": (lambda c, t: _set(c, "norm_output", False),
                          "norm_output is False but the draft was trained with True"),
    "norm_before_fc without input_norm": (lambda c, t: t.pop("input_norm.weight"), "missing tensor input_norm.weight"),
    "input_norm without its flag": (lambda c, t: (_set(c, "norm_before_fc", False),
                                                  _set(c["eagle_config"], "norm_before_fc", False)),
                                    "input_norm.weight is present but its flag is off"),
    "head_dim vs q_proj": (lambda c, t: _set(c, "head_dim", 32), "head_dim should be 64, config says 32"),
    "vocab size": (lambda c, t: _set(c, "vocab_size", c["vocab_size"] + 1), "differs from the verifier's"),
    "hidden_act": (lambda c, t: _set(c, "hidden_act", "gelu"), "supports only silu"),
    "d2t with full vocab": (lambda c, t: (_set(c, "draft_vocab_size", c["vocab_size"]),
                                          _set(t, "lm_head.weight", torch.zeros(c["vocab_size"], 128))),
                            "d2t is present with a full draft vocabulary"),
    "d2t missing": (lambda c, t: t.pop("d2t"), "missing tensor d2t"),
    "d2t out of range": (lambda c, t: t["d2t"].__setitem__(-1, 10**6), "outside the verifier vocabulary"),
    "d2t not unique": (lambda c, t: t["d2t"].__setitem__(1, t["d2t"][0] - 1), "already taken"),
    "d2t float": (lambda c, t: _set(t, "d2t", t["d2t"].float()), "must be an integer offset"),
    "lm_head rows": (lambda c, t: _set(t, "lm_head.weight", torch.zeros(DRAFT_VOCAB + 1, 128)),
                     "lm_head.weight has shape [129, 128]"),
    "fc inputs": (lambda c, t: _set(t, "fc.weight", torch.zeros(128, 256)), "fc takes 256 inputs"),
    "target hidden size": (lambda c, t: _set(c, "target_hidden_size", 64), "target_hidden_size 64 differs"),
    "architecture": (lambda c, t: _set(c, "architectures", ["LlamaForCausalLM"]), "architectures is"),
    "sliding window": (lambda c, t: (_set(c, "layer_types", ["sliding_attention"]), c.pop("sliding_window")),
                       "sliding_window is not set"),
}


def broken_copy(flat: Path, out: Path, change) -> Path:
    shutil.copytree(flat, out)
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_tensors(out)
    change(cfg, tensors)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("hazard", sorted(HAZARDS))
def test_validate_names_each_hazard(hazard, flat, tiny_verifier, tmp_path):
    change, expected = HAZARDS[hazard]
    broken = broken_copy(flat, tmp_path / "broken", change)
    problems = validate(broken, str(tiny_verifier)).problems
    assert any(expected in p for p in problems), problems


def test_validate_cli_reports_every_problem_at_once(flat, tiny_verifier, tmp_path):
    def several(c, t):
        t.pop("layers.0.hidden_norm.weight")
        c["hidden_act"] = "gelu"
        c.pop("eagle_aux_hidden_state_layer_ids")

    broken = broken_copy(flat, tmp_path / "broken", several)
    proc = run_cli(["validate", str(broken), "--verifier", str(tiny_verifier)])
    assert proc.returncode == 1
    problems = [line for line in proc.stdout.splitlines() if line.startswith("problem: ")]
    assert len(problems) == 3, proc.stdout
    assert "3 problem(s)" in proc.stdout
    good = run_cli(["validate", str(flat), "--verifier", str(tiny_verifier)])
    assert good.returncode == 0 and good.stdout.strip().endswith(": ok"), good.stdout


# --- conversions never half-write ------------------------------------------------------------------------------

def test_flatten_in_place_keeps_a_backup(nested, tiny_verifier, tmp_path):
    src = tmp_path / "draft"
    shutil.copytree(nested, src)
    proc = run_cli(["flatten", str(src), "--out", str(src), "--verifier", str(tiny_verifier)])
    assert proc.returncode == 0, proc.stderr
    assert json.loads((src / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    backup = tmp_path / "draft.bak"
    assert (backup / "model.safetensors").read_bytes() == (nested / "model.safetensors").read_bytes()
    other = tmp_path / "other"
    shutil.copytree(nested, other)
    (tmp_path / "other.bak").mkdir()  # a backup already there is never overwritten
    again = run_cli(["flatten", str(other), "--out", str(other), "--verifier", str(tiny_verifier)])
    assert again.returncode == 2 and "other.bak exists" in again.stderr, again.stderr
    assert (other / "config.json").read_bytes() == (nested / "config.json").read_bytes()


def test_existing_output_is_refused(nested, flat, tiny_verifier):
    with pytest.raises(EagletError, match="exists"):
        flatten(nested, flat, str(tiny_verifier))


def test_failed_conversion_leaves_nothing(nested, tiny_verifier, tmp_path, monkeypatch):

    def disk_full(*_a, **_k):
        raise OSError("No space left on device")

    monkeypatch.setattr(flat_form, "save_file", disk_full)
    with pytest.raises(OSError):
        flatten(nested, tmp_path / "flat", str(tiny_verifier))
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary directory


def test_user_errors_are_one_sentence(nested, flat, tiny_verifier, tmp_path):
    proc = run_cli(["flatten", str(flat), "--verifier", str(tiny_verifier), "--out", str(tmp_path / "x")])
    assert proc.returncode == 2 and "is not a speculators checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli(["unflatten", str(nested), "--verifier", str(tiny_verifier), "--out", str(tmp_path / "y")])
    assert proc.returncode == 2 and "already a speculators checkpoint" in proc.stderr
    proc = run_cli(["flatten", str(nested), "--out", str(tmp_path / "z")])  # the recorded verifier path is fine
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(["validate", str(tmp_path / "nowhere"), "--verifier", str(tiny_verifier)])
    assert proc.returncode == 2 and "no config.json" in proc.stderr
