"""Bad input stops the flow with one clear message before any weights are loaded, leaving nothing half-written."""

import json
import shutil

import pytest

from eaglet.capture import hf_forward
from eaglet.config import load_config
from eaglet.errors import EagletError
from tests.conftest import run_cli


@pytest.fixture
def fresh_store(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLET_HOME", str(tmp_path / "store"))
    return tmp_path / "store"


def run_flow(sets, out):
    from flows.train_eagle3 import train_eagle3

    return train_eagle3(params=load_config(None, sets), output_dir=str(out))


def assert_nothing_loaded_or_written(store, out):
    assert hf_forward.VERIFIER_LOADS == 0
    heavy = {"responses", "hidden_states", "vocab", "draft_ckpt", "draft_flat"}
    assert not [p for p in store.glob("*") if p.name in heavy]
    assert not list(store.glob("*/.tmp-*"))
    assert not out.exists()


def data_file(tmp_path, rows):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def verifier_variant(tiny_verifier, tmp_path, change):
    v = tmp_path / "v"
    shutil.copytree(tiny_verifier, v)
    change(v)
    return v


def drop_template(v):
    cfg = json.loads((v / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (v / "tokenizer_config.json").write_text(json.dumps(cfg))
    (v / "chat_template.jinja").unlink(missing_ok=True)


def to_pickle(v):
    (v / "model.safetensors").rename(v / "pytorch_model.bin")


def needs_remote_code(v):
    cfg = json.loads((v / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}
    (v / "config.json").write_text(json.dumps(cfg))


PROMPTS = [{"prompt": f"question {i}"} for i in range(60)]


@pytest.mark.parametrize("case, message", [
    ("missing dataset", "does not exist"),
    ("empty dataset", "is empty"),
    ("no assistant turn", "no assistant turn"),
    ("unknown row shape", "unknown row shape"),
    ("no chat template", "no chat template"),
    ("aux ids out of range", "outside the verifier's layers"),
    ("draft vocab too large", "larger than the verifier's vocabulary"),
    ("pickle-only weights", "only pickle weights"),
    ("remote code not allowed", "trust_remote_code"),
])
@pytest.mark.e2e  # the flow, in this process
def test_bad_input_fails_before_weights(case, message, tiny_verifier, tmp_path, fresh_store):
    v, data = tiny_verifier, data_file(tmp_path, PROMPTS)
    sets = []
    if case == "missing dataset":
        data = tmp_path / "missing.jsonl"
    elif case == "empty dataset":
        data.write_text("")
    elif case == "no assistant turn":
        sets.append("data.regenerate=false")
    elif case == "unknown row shape":
        data = data_file(tmp_path, [{"text": "hi"}] * 60)
    elif case == "no chat template":
        v = verifier_variant(tiny_verifier, tmp_path, drop_template)
    elif case == "aux ids out of range":
        sets.append("verifier.aux_layer_ids=[2, 4, 8]")
    elif case == "draft vocab too large":
        sets.append("draft.draft_vocab_size=100000")
    elif case == "pickle-only weights":
        v = verifier_variant(tiny_verifier, tmp_path, to_pickle)
    elif case == "remote code not allowed":
        v = verifier_variant(tiny_verifier, tmp_path, needs_remote_code)
    out = tmp_path / "out"
    with pytest.raises(EagletError, match=message):
        run_flow(sets + [f"verifier.path={v}", f"data.path={data}", "data.eval_fraction=0.25"], out)
    assert_nothing_loaded_or_written(fresh_store, out)


@pytest.mark.parametrize("override, message", [
    ("verifier.aux_layer_ids=[2, 15, 30]", "outside the verifier's layers"),
    ("draft.draft_vocab_size=60000", "larger than the verifier's vocabulary"),
])
@pytest.mark.e2e  # the flow, in this process
def test_embedded_verifier_parameters_checked_before_conversion(override, message, tmp_path, fresh_store):
    """The embedded verifier's conversion dequantizes weights: bad parameters must fail before it."""
    out = tmp_path / "out"
    with pytest.raises(EagletError, match=message):
        run_flow([override, f"data.path={data_file(tmp_path, PROMPTS)}", "data.eval_fraction=0.25"], out)
    assert not (fresh_store / "verifier").exists()
    assert_nothing_loaded_or_written(fresh_store, out)


def test_duplicate_aux_ids_rejected_by_the_parameters():
    with pytest.raises(EagletError, match="duplicates"):
        load_config(None, ["verifier.aux_layer_ids=[2, 4, 4]"])


@pytest.mark.e2e  # `eaglet run`, which fails in its first task
def test_cli_prints_one_sentence(tiny_verifier, tmp_path):
    proc = run_cli(["run", f"--set=verifier.path={tiny_verifier}", f"--set=data.path={tmp_path / 'nope.jsonl'}",
                    "--output-dir", str(tmp_path / "out")], env_extra={"EAGLET_HOME": str(tmp_path / "store")})
    assert proc.returncode == 2
    ours = [line for line in proc.stderr.splitlines() if line.startswith("eaglet: error:")]
    assert len(ours) == 1 and "dataset" in ours[0] and "does not exist" in ours[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists()
