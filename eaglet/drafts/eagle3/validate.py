"""Every hazard of a flat EAGLE-3 draft that vLLM's loader would fail on or silently mis-serve, found without
starting vLLM. vLLM reports none of these itself: missing tensors load as zeros, unexpected biases are dropped,
and wrong aux ids or norm flags load fine and accept almost nothing."""

from __future__ import annotations

import json
from pathlib import Path

from eaglet.drafts.base import ValidationReport
from eaglet.drafts.checkpoint import is_nested, load_tensor, read_config, tensor_meta
from eaglet.drafts.eagle3.form import (FLAT_ARCH, FLAT_ARCHS, NORM_FLAGS, SAFETENSORS_TO_TORCH, SPECULATORS_DEFAULTS,
                                      VLLM_FLAT_DEFAULTS, aux_count, aux_ids_of)
from eaglet.errors import EagletError
from eaglet.verifier import read_config_dict, text_config_of


def expected_shapes(cfg: dict, prefix: str) -> dict[str, list[int]]:
    """Every tensor vLLM's EAGLE-3 Llama draft has a parameter for, with the shape the config implies."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    target = cfg.get("target_hidden_size") or h
    n_aux = aux_count(cfg)
    shapes = {
        "fc.weight": [h, n_aux * target],
        "norm.weight": [h],
        "lm_head.weight": [cfg.get("draft_vocab_size") or cfg["vocab_size"], h],
    }
    for i in range(cfg.get("num_hidden_layers", 1)):
        p = prefix if i == 0 else f"layers.{i}"
        d_in = 2 * h if i == 0 else h  # the first EAGLE-3 layer attends over [embeddings, hidden]
        shapes.update({
            f"{p}.self_attn.q_proj.weight": [heads * hd, d_in],
            f"{p}.self_attn.k_proj.weight": [kv * hd, d_in],
            f"{p}.self_attn.v_proj.weight": [kv * hd, d_in],
            f"{p}.self_attn.o_proj.weight": [h, heads * hd],
            f"{p}.mlp.gate_proj.weight": [inter, h],
            f"{p}.mlp.up_proj.weight": [inter, h],
            f"{p}.mlp.down_proj.weight": [h, inter],
            f"{p}.input_layernorm.weight": [h],
            f"{p}.post_attention_layernorm.weight": [h],
        })
        if i == 0:
            shapes[f"{p}.hidden_norm.weight"] = [h]
        if cfg.get("attention_bias"):
            shapes.update({f"{p}.self_attn.{x}_proj.bias": [r] for x, r in
                           (("q", heads * hd), ("k", kv * hd), ("v", kv * hd), ("o", h))})
        if cfg.get("mlp_bias"):
            shapes.update({f"{p}.mlp.gate_proj.bias": [inter], f"{p}.mlp.up_proj.bias": [inter],
                           f"{p}.mlp.down_proj.bias": [h]})
    return shapes


def validate(draft: Path, verifier: str) -> ValidationReport:
    """Check a flat draft against vLLM's EAGLE-3 loader and the verifier, without starting vLLM.

    vLLM reports none of these itself: missing tensors load as zeros, unexpected biases are dropped, and wrong
    aux ids or norm flags load fine and accept almost nothing.
    """
    import torch  # heavy: only for the d2t check

    draft = Path(draft)
    r = ValidationReport()
    cfg = read_config(draft)
    if is_nested(cfg):
        raise EagletError(f"{draft} is a speculators (nested) checkpoint: `eaglet flatten` it first")
    vcfg = text_config_of(read_config_dict(Path(verifier)))
    meta = tensor_meta(draft)
    P = r.problems.append
    W = r.warnings.append

    # architecture and fields vLLM requires
    if (cfg.get("architectures") or [None])[0] not in FLAT_ARCHS:
        P(f"architectures is {cfg.get('architectures')}, vLLM's EAGLE-3 Llama draft needs [\"{FLAT_ARCH}\"]")
    if cfg.get("model_type") != "llama":
        P(f"model_type is {cfg.get('model_type')!r}, must be 'llama'")
    missing_fields = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                                  "rms_norm_eps") if k not in cfg]
    if missing_fields:
        P(f"config lacks {', '.join(missing_fields)}")
        return r
    if cfg.get("hidden_act", "silu") != "silu":
        P(f"hidden_act is {cfg['hidden_act']!r}: vLLM's EAGLE-3 Llama layer supports only silu")
    if "head_dim" not in cfg:
        W(f"head_dim is not set: vLLM derives hidden_size/num_attention_heads = "
          f"{cfg['hidden_size'] // cfg['num_attention_heads']}")

    # verifier agreement
    if cfg["vocab_size"] != vcfg.get("vocab_size"):
        P(f"vocab_size {cfg['vocab_size']} differs from the verifier's {vcfg.get('vocab_size')} (vLLM requires equality)")
    target = cfg.get("target_hidden_size") or cfg["hidden_size"]
    if target != vcfg.get("hidden_size"):
        P(f"target_hidden_size {target} differs from the verifier's hidden_size {vcfg.get('hidden_size')}")

    # aux layer ids
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    eagle = cfg.get("eagle_config") or {}
    nested_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    layers = vcfg.get("num_hidden_layers", 0)
    if top is None:
        P("eagle_aux_hidden_state_layer_ids is not at the top level: vLLM's GPU runner then captures the default "
          f"layers {[2, layers // 2, layers - 3]}" + (f", not {nested_ids}" if nested_ids else ""))
    elif nested_ids is not None and list(nested_ids) != list(top):
        P(f"aux layer ids differ: top level {top}, eagle_config {nested_ids}")
    ids = aux_ids_of(cfg)
    if ids is not None:
        if len(set(ids)) != len(ids):
            P(f"aux layer ids {ids} have duplicates: vLLM captures each layer once, so fc gets too few inputs")
        elif list(ids) != sorted(ids):
            P(f"aux layer ids {ids} are not ascending: vLLM concatenates the captured layers in ascending order")
        if any(not 0 <= i < layers for i in ids):
            P(f"aux layer ids {ids} are outside the verifier's layers 0..{layers - 1}")
        if cfg.get("num_aux_hidden_states") is not None and cfg["num_aux_hidden_states"] != len(ids):
            P(f"num_aux_hidden_states {cfg['num_aux_hidden_states']} != {len(ids)} aux layer ids")
    if eagle.get("use_aux_hidden_state") is False:
        P("eagle_config.use_aux_hidden_state is false: vLLM then ignores fc and feeds no verifier states")

    # norm flags: explicit, as trained, and consistent with the weights
    trained = _trained_flags(draft)
    for flag in NORM_FLAGS:
        used = bool(cfg.get(flag, VLLM_FLAT_DEFAULTS[flag]))
        if trained is not None and trained[flag] != used:
            how = "is missing, and vLLM's flat default is" if flag not in cfg else "is"
            P(f"{flag} {how} {used} but the draft was trained with {trained[flag]} (config_speculators.json)")
        elif flag == "norm_before_residual" and flag not in cfg:
            W("norm_before_residual is not set: vLLM uses False for flat configs (speculators' default is True)")
    if "norm_before_fc" in eagle and "norm_before_fc" in cfg and eagle["norm_before_fc"] != cfg["norm_before_fc"]:
        P(f"norm_before_fc differs: top level {cfg['norm_before_fc']}, eagle_config {eagle['norm_before_fc']}")

    # tensors: names, shapes, dtypes
    prefixes = {p for p in ("layers.0", "midlayer") if any(k.startswith(p + ".") for k in meta)}
    if len(prefixes) > 1:
        P("both midlayer.* and layers.0.* tensors are present: keep one naming")
    prefix = "midlayer" if prefixes == {"midlayer"} else "layers.0"
    expected = expected_shapes(cfg, prefix)
    norm_before_fc = bool(cfg.get("norm_before_fc", eagle.get("norm_before_fc", False)))
    n_aux, hidden = aux_count(cfg), target
    if norm_before_fc:
        expected["input_norm.weight"] = [n_aux * hidden]
    if cfg.get("fc_norm"):
        expected.update({f"fc_norm.{i}.weight": [hidden] for i in range(n_aux)})
    draft_vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    optional = {"embed_tokens.weight": [cfg["vocab_size"], cfg["hidden_size"]]}
    if draft_vocab != cfg["vocab_size"]:
        expected["d2t"] = [draft_vocab]
    for name, shape in expected.items():
        if name not in meta:
            P(f"missing tensor {name} {shape} (vLLM does not report it and leaves the weight uninitialised)")
        elif meta[name][0] != shape:
            P(f"{name} has shape {meta[name][0]}, the config implies {shape}" + _shape_hint(name, meta, cfg))
    for name, (shape, dtype) in meta.items():
        if name in expected or name in optional:
            if name in optional and shape != optional[name]:
                P(f"{name} has shape {shape}, expected {optional[name]}")
            continue
        if name == "t2d":
            W("t2d is present: vLLM ignores it")
        elif name == "d2t":
            P("d2t is present with a full draft vocabulary: vLLM rejects it")
        elif name.endswith(".bias"):
            P(f"unexpected bias {name}: vLLM drops it silently (attention_bias/mlp_bias are off)")
        elif name.startswith("input_norm.") or name.startswith("fc_norm."):
            P(f"{name} is present but its flag is off: vLLM would not apply it (set the flag it was trained with)")
        else:
            hint = " (flat drafts carry no 'model.' prefix)" if name.startswith("model.") else ""
            P(f"unexpected tensor {name}: vLLM has no parameter of that name and fails to load{hint}")
    if "embed_tokens.weight" not in meta and cfg["hidden_size"] != vcfg.get("hidden_size"):
        P("embed_tokens.weight is absent and the draft's hidden_size differs from the verifier's, so vLLM "
          "cannot share the verifier's embeddings")
    want_dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    float_dtypes = {n: d for n, (_, d) in meta.items() if n not in ("d2t", "t2d")}
    odd = sorted(n for n, d in float_dtypes.items() if d not in SAFETENSORS_TO_TORCH)
    if odd:
        P(f"tensors {odd[:3]} are not floating point ({float_dtypes[odd[0]]}) and no quantization is configured")
    mismatched = sorted(n for n, d in float_dtypes.items() if SAFETENSORS_TO_TORCH.get(d, want_dtype) != want_dtype)
    if want_dtype and mismatched:
        W(f"{len(mismatched)} tensors (e.g. {mismatched[0]}: {float_dtypes[mismatched[0]]}) differ from the "
          f"config dtype {want_dtype}; vLLM casts them")

    # d2t: offsets onto distinct verifier ids
    if "d2t" in meta and meta["d2t"][0] == [draft_vocab]:
        if meta["d2t"][1] not in ("I64", "I32"):
            P(f"d2t has dtype {meta['d2t'][1]}, must be an integer offset (int64)")
        else:
            d2t = load_tensor(draft, "d2t").to(torch.long)
            targets = torch.arange(d2t.shape[0]) + d2t
            bad = ((targets < 0) | (targets >= cfg["vocab_size"])).sum().item()
            if bad:
                P(f"d2t maps {bad} draft ids outside the verifier vocabulary 0..{cfg['vocab_size'] - 1}")
            dup = targets.numel() - targets.unique().numel()
            if dup:
                P(f"d2t maps {dup} draft ids onto verifier ids already taken (targets must be unique)")

    # layer types
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != cfg.get("num_hidden_layers", 1):
            P(f"layer_types has {len(types)} entries for {cfg.get('num_hidden_layers', 1)} layers")
        if "sliding_attention" in types and not cfg.get("sliding_window"):
            P("layer_types has sliding_attention but sliding_window is not set")
    return r


def _shape_hint(name: str, meta: dict, cfg: dict) -> str:
    if name.endswith("q_proj.weight"):
        rows = meta[name][0][0]
        return (f" (q_proj has {rows} rows: head_dim should be {rows // cfg['num_attention_heads']}, "
                f"config says {cfg.get('head_dim', cfg['hidden_size'] // cfg['num_attention_heads'])})")
    if name == "fc.weight":
        return f" (fc takes {meta[name][0][1]} inputs: check the aux layer count and target_hidden_size)"
    return ""


def _trained_flags(draft: Path) -> dict | None:
    original = draft / "config_speculators.json"
    if not original.is_file():
        return None
    nested = json.loads(original.read_text())
    return {f: bool(nested.get(f, SPECULATORS_DEFAULTS[f])) for f in NORM_FLAGS}


def check_flat_draft(draft: Path, verifier: str) -> ValidationReport:
    return validate(draft, verifier).raise_problems(draft)


