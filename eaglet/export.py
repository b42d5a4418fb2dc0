"""speculators' nested Eagle3 checkpoint -> vLLM's flat `LlamaForCausalLMEagle3` checkpoint.

vLLM reads every transformer field at the top level, the aux layer ids at the top level *and* in `eagle_config`
(its GPU runner only reads the top level), and defaults `norm_before_residual` to False in flat configs, so
every norm flag the draft was trained with is written explicitly. `d2t` is kept only when the draft vocabulary is
smaller than the verifier's (vLLM errors on it otherwise); `t2d` is dropped (vLLM ignores it); optimizer and
scheduler state are not copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from eaglet.verifier import read_config_dict, text_config_of

FLAT_ARCH = "LlamaForCausalLMEagle3"
LAYER_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "attention_bias", "attention_dropout", "mlp_bias",
    "rope_parameters", "rope_theta", "rope_scaling", "layer_types", "sliding_window", "use_sliding_window",
    "initializer_range", "pretraining_tp",
)
NORM_FLAGS = {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def load_state(path: Path) -> dict:
    import torch  # noqa: F401 - safetensors' pt framework needs torch

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def flat_config(nested: dict, verifier_config: dict, head_dim: int, serving_id: str | None = None) -> dict:
    layer = nested["transformer_layer_config"]
    text = text_config_of(verifier_config)
    ids = list(nested["eagle_aux_hidden_state_layer_ids"])
    cfg = {"architectures": [FLAT_ARCH], "model_type": "llama"}
    cfg.update({k: layer[k] for k in LAYER_FIELDS if k in layer and layer[k] is not None})
    cfg["head_dim"] = head_dim  # explicit: vLLM otherwise derives hidden/heads, which may differ from the weights
    cfg["num_hidden_layers"] = 1
    cfg["vocab_size"] = text["vocab_size"]
    cfg["draft_vocab_size"] = nested.get("draft_vocab_size") or text["vocab_size"]
    cfg["target_hidden_size"] = nested.get("target_hidden_size") or text["hidden_size"]
    cfg["tie_word_embeddings"] = False
    for flag, default in NORM_FLAGS.items():
        cfg[flag] = bool(nested.get(flag, default))
    cfg["eagle_aux_hidden_state_layer_ids"] = ids
    cfg["num_aux_hidden_states"] = len(ids)
    cfg["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": ids,
        "use_aux_hidden_state": True,
        "norm_before_fc": cfg["norm_before_fc"],
    }
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if text.get(tok) is not None:
            cfg[tok] = text[tok]
    cfg["dtype"] = nested.get("dtype", "bfloat16")
    if serving_id:
        cfg["speculators_verifier"] = serving_id
    return cfg


def flatten_checkpoint(src: Path, dst: Path, verifier_path: str, serving_id: str | None = None,
                       layer_prefix: str = "layers.0") -> dict:
    """Write the flat vLLM draft for the speculators checkpoint `src` into the (empty) directory `dst`."""
    nested = json.loads((src / "config.json").read_text())
    verifier_config = read_config_dict(Path(verifier_path))
    state = load_state(src)
    q = state["layers.0.self_attn.q_proj.weight"]
    heads = nested["transformer_layer_config"]["num_attention_heads"]
    cfg = flat_config(nested, verifier_config, head_dim=q.shape[0] // heads, serving_id=serving_id)

    out = {}
    for name, t in state.items():
        if name == "t2d":
            continue
        if name == "d2t" and cfg["draft_vocab_size"] >= cfg["vocab_size"]:
            continue
        if name.startswith("layers.0.") and layer_prefix != "layers.0":
            name = layer_prefix + name[len("layers.0"):]
        out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    shutil.copy(src / "config.json", dst / "config_speculators.json")
    return cfg


EXPORT_VERSION = "flat-1"
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight")
LAYER_TENSORS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
)


def flat_draft_problems(draft: Path, verifier_path: str) -> list[str]:
    """Shape and presence checks of a flat draft against its config and verifier (vLLM reports none of these)."""
    cfg = json.loads((draft / "config.json").read_text())
    vtext = text_config_of(read_config_dict(Path(verifier_path)))
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    problems = []
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in shapes) else "layers.0."
    for name in REQUIRED + tuple(prefix + t for t in LAYER_TENSORS):
        if name not in shapes:
            problems.append(f"missing tensor {name}")
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim", hidden // heads)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or []
    q = shapes.get(prefix + "self_attn.q_proj.weight")
    if q and q[0] != heads * head_dim:
        problems.append(f"q_proj has {q[0]} rows but num_attention_heads*head_dim = {heads * head_dim}")
    fc = shapes.get("fc.weight")
    target_hidden = cfg.get("target_hidden_size", hidden)
    if fc and fc[1] != len(ids) * target_hidden:
        problems.append(f"fc.weight takes {fc[1]} inputs but {len(ids)} aux layers x {target_hidden} are configured")
    if cfg.get("vocab_size") != vtext.get("vocab_size"):
        problems.append(f"vocab_size {cfg.get('vocab_size')} differs from the verifier's {vtext.get('vocab_size')}")
    draft_vocab = cfg.get("draft_vocab_size", cfg.get("vocab_size"))
    lm = shapes.get("lm_head.weight")
    if lm and lm[0] != draft_vocab:
        problems.append(f"lm_head.weight has {lm[0]} rows but draft_vocab_size is {draft_vocab}")
    if draft_vocab < cfg.get("vocab_size", 0) and "d2t" not in shapes:
        problems.append("d2t is missing although the draft vocabulary is smaller than the verifier's")
    if draft_vocab >= cfg.get("vocab_size", 0) and "d2t" in shapes:
        problems.append("d2t is present with a full vocabulary (vLLM rejects it)")
    if len(set(ids)) != len(ids) or sorted(ids) != ids:
        problems.append(f"aux layer ids {ids} must be unique and ascending")
    if any(not 0 <= i < vtext.get("num_hidden_layers", 0) for i in ids):
        problems.append(f"aux layer ids {ids} are outside the verifier's layers")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg.get('hidden_act')} is not silu (vLLM's EAGLE-3 Llama layer needs silu)")
    if cfg.get("norm_before_fc") and "input_norm.weight" not in shapes:
        problems.append("norm_before_fc is set but input_norm.weight is missing")
    return problems


def check_flat_draft(draft: Path, verifier_path: str) -> None:
    from eaglet.errors import EagletError

    problems = flat_draft_problems(draft, verifier_path)
    if problems:
        raise EagletError(f"draft {draft} is not loadable by vLLM: " + "; ".join(problems))
