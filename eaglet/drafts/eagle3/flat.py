"""speculators' nested Eagle3 checkpoint <-> vLLM's flat `LlamaForCausalLMEagle3` checkpoint (eaglet.drafts.eagle3.form).

What the flat form needs, as vLLM's `llama_eagle3.py` reads it:
- every decoder field at the top level, with an explicit `head_dim` (vLLM otherwise derives hidden/heads);
- the aux layer ids at the top level *and* in `eagle_config`, plus `num_aux_hidden_states` (the GPU runner reads
  only the top level and silently falls back to (2, L//2, L-3));
- every norm flag written explicitly: flat configs default `norm_before_residual` to False, speculators to True;
- `d2t` only when the draft vocabulary is smaller (vLLM errors on it otherwise), `t2d` dropped (ignored),
  `embed_tokens` dropped when identical to the verifier's (vLLM shares the verifier's), optimizer state never
  copied. The nested config is kept as `config_speculators.json`.

Nothing is written in place: conversions go to a temporary directory that is renamed into place, and a source
that is converted onto itself is first moved to a backup.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from eaglet.drafts.checkpoint import is_nested, load_tensors, read_config, staged_output, tensor_meta, write_json
from eaglet.drafts.eagle3.form import (FLAT_ARCH, LAYER_FIELDS, NORM_FLAGS, SAFETENSORS_TO_TORCH, SPECULATORS_DEFAULTS,
                                      VLLM_FLAT_DEFAULTS)
from eaglet.drafts.eagle3.validate import validate
from eaglet.errors import EagletError
from eaglet.verifier import read_config_dict, text_config_of


# --- nested -> flat -----------------------------------------------------------------------------------------

def flat_config(nested: dict, verifier_config: dict, q_rows: int, dtype: str | None = None) -> dict:
    """The flat vLLM config of a nested speculators config. `q_rows` (q_proj's output rows) fixes head_dim."""
    layer = nested["transformer_layer_config"]
    text = text_config_of(verifier_config)
    ids = list(nested.get("eagle_aux_hidden_state_layer_ids") or [])
    cfg = {"architectures": [FLAT_ARCH], "model_type": "llama"}
    cfg.update({k: layer[k] for k in LAYER_FIELDS if layer.get(k) is not None})
    rope = layer.get("rope_parameters") or {}
    if "rope_theta" not in cfg and isinstance(rope, dict) and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]  # older readers look for it at the top level
    cfg["head_dim"] = q_rows // layer["num_attention_heads"]
    cfg["num_hidden_layers"] = layer.get("num_hidden_layers", 1)
    cfg["vocab_size"] = text["vocab_size"]
    cfg["draft_vocab_size"] = nested.get("draft_vocab_size") or text["vocab_size"]
    cfg["target_hidden_size"] = nested.get("target_hidden_size") or text["hidden_size"]
    cfg["tie_word_embeddings"] = False
    for flag in NORM_FLAGS:
        cfg[flag] = bool(nested.get(flag, SPECULATORS_DEFAULTS[flag]))
    cfg["eagle_aux_hidden_state_layer_ids"] = ids
    cfg["num_aux_hidden_states"] = len(ids)
    cfg["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": ids,
        "use_aux_hidden_state": True,
        "norm_before_fc": cfg["norm_before_fc"],
    }
    for tok in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = text.get(tok, verifier_config.get(tok))
        if value is not None:
            cfg[tok] = value
    cfg["dtype"] = dtype or layer.get("dtype") or nested.get("dtype") or "bfloat16"
    return cfg


def flatten(src: Path, dst: Path, verifier: str | None = None, serving_id: str | None = None,
            layer_prefix: str = "layers.0", keep_embeddings: bool = False) -> dict:
    """Write the flat vLLM draft for the speculators checkpoint `src` to `dst` (atomically); return its config."""
    src, dst = Path(src), Path(dst)
    recorded = read_config(src).get("speculators_config", {}).get("verifier", {}).get("name_or_path")
    with staged_output(src, dst) as tmp:
        return write_flat(src, tmp, verifier or recorded, serving_id, layer_prefix, keep_embeddings)


def write_flat(src: Path, out: Path, verifier: str | None, serving_id: str | None = None,
               layer_prefix: str = "layers.0", keep_embeddings: bool = False) -> dict:
    """Write the flat draft of `src` into the empty directory `out`."""
    nested = read_config(src)
    if not is_nested(nested):
        raise EagletError(f"{src} is not a speculators checkpoint (no speculators_config in config.json); "
                          "`eaglet validate` checks a flat draft, `eaglet unflatten` converts one back")
    if not verifier or not (Path(verifier) / "config.json").is_file():
        raise EagletError(f"the verifier {verifier!r} of {src} is not a local checkpoint: pass --verifier PATH")
    if layer_prefix not in ("layers.0", "midlayer"):
        raise EagletError(f"layer prefix {layer_prefix!r} must be 'layers.0' or 'midlayer'")
    verifier_config = read_config_dict(Path(verifier))
    meta = tensor_meta(src)
    q_name = "layers.0.self_attn.q_proj.weight"
    if q_name not in meta or "fc.weight" not in meta:
        raise EagletError(f"{src} lacks {q_name} or fc.weight: not an Eagle3 draft")
    cfg = flat_config(nested, verifier_config, q_rows=meta[q_name][0][0],
                      dtype=SAFETENSORS_TO_TORCH.get(meta["fc.weight"][1]))

    state = load_tensors(src)
    if "embed_tokens.weight" in state and not keep_embeddings and _same_as_verifier_embeddings(
            state["embed_tokens.weight"], verifier):
        del state["embed_tokens.weight"]
    tensors = {}
    for name, t in state.items():
        if name == "t2d" or (name == "d2t" and cfg["draft_vocab_size"] >= cfg["vocab_size"]):
            continue
        if name.startswith("layers.0.") and layer_prefix == "midlayer":
            name = "midlayer." + name[len("layers.0."):]
        tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", cfg)
    if serving_id:  # the training machine's path means nothing where the draft is served
        spec = nested["speculators_config"]
        nested = {**nested, "speculators_config": {**spec, "verifier": {**spec["verifier"], "name_or_path": serving_id}}}
    write_json(out / "config_speculators.json", nested)
    return cfg


def _same_as_verifier_embeddings(embed, verifier: str) -> bool:
    import torch
    from speculators.utils.loading import load_model_layers  # finds the tensor by suffix in any shard layout

    theirs = load_model_layers(["embed_tokens.weight"], verifier)["embed_tokens.weight"]
    return theirs.shape == embed.shape and torch.equal(theirs.to(embed.dtype), embed)


# --- flat -> nested -----------------------------------------------------------------------------------------

def unflatten(src: Path, dst: Path, verifier: str, speculative_tokens: int = 3) -> dict:
    """Write a speculators checkpoint for the flat draft `src`, so speculators can fine-tune it."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    src, dst = Path(src), Path(dst)
    flat = read_config(src)
    if is_nested(flat):
        raise EagletError(f"{src} is already a speculators checkpoint: nothing to unflatten")
    if not (Path(verifier) / "config.json").is_file():
        raise EagletError(f"verifier {verifier!r} is not a local checkpoint directory with a config.json")
    problems = validate(src, verifier).problems
    if problems:
        raise EagletError(f"{src} is not a valid flat draft: " + "; ".join(problems))

    ids = flat.get("eagle_aux_hidden_state_layer_ids") or flat["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    layer = LlamaConfig(**{k: flat[k] for k in LAYER_FIELDS if k in flat}, vocab_size=flat["vocab_size"],
                        num_hidden_layers=flat.get("num_hidden_layers", 1), tie_word_embeddings=False)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=flat.get("draft_vocab_size", flat["vocab_size"]),
        target_hidden_size=flat.get("target_hidden_size"),
        eagle_aux_hidden_state_layer_ids=list(ids),
        **{f: bool(flat.get(f, VLLM_FLAT_DEFAULTS[f])) for f in NORM_FLAGS},
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(verifier),
        ),
    )
    state = load_tensors(src)
    out = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    if "d2t" in out:  # speculators keeps both directions; t2d marks the verifier ids the draft can propose
        d2t = out["d2t"].to(torch.long)
        t2d = torch.zeros(flat["vocab_size"], dtype=torch.bool)
        t2d[torch.arange(d2t.shape[0]) + d2t] = True
        out["d2t"], out["t2d"] = d2t, t2d
    with staged_output(src, dst) as tmp:
        save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        nested = config.to_dict()
        write_json(tmp / "config.json", nested)
    return nested


