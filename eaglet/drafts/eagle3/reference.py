"""draft.like: a published flat EAGLE-3 draft whose shapes a new draft takes (decoder sizes, draft vocabulary,
aux layer count, input norm), so it drops in where that draft is served."""

from __future__ import annotations

from pathlib import Path

from eaglet.config import RunConfig
from eaglet.drafts.checkpoint import is_nested
from eaglet.drafts.eagle3.form import LAYER_FIELDS, VLLM_FLAT_DEFAULTS, aux_ids_of
from eaglet.errors import EagletError, read_json_file



def read_reference(path: str | Path) -> dict:
    """A flat reference config (`draft.like`): a file, or a draft directory holding config.json."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise EagletError(f"draft.like {path} is neither a config file nor a directory with config.json")
    ref = read_json_file(file, "draft.like")
    if is_nested(ref):
        raise EagletError(f"draft.like {file} is a speculators config: give the flat config (`eaglet flatten` it)")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in ref]
    if missing:
        raise EagletError(f"draft.like {file} lacks {', '.join(missing)}: not a flat EAGLE-3 draft config")
    if ref.get("hidden_act", "silu") != "silu":
        raise EagletError(f"draft.like {file} uses hidden_act {ref['hidden_act']!r}; vLLM's EAGLE-3 draft needs silu")
    return ref


def reference_layer_config(ref: dict) -> dict:
    """The decoder config (speculators' `--draft-config`) that gives the draft the reference's weight shapes.

    head_dim is written explicitly: AQ-MedAI's Kimi draft projects 7168 -> 64 x 128, where hidden/heads is 112.
    """
    layer = {k: ref[k] for k in LAYER_FIELDS if ref.get(k) is not None}
    layer.setdefault("head_dim", ref["hidden_size"] // ref["num_attention_heads"])
    layer.update(model_type="llama", num_hidden_layers=ref.get("num_hidden_layers", 1),
                 vocab_size=ref["vocab_size"], tie_word_embeddings=False)
    if "rope_parameters" not in layer and "rope_theta" in layer:
        layer["rope_parameters"] = {"rope_type": "default", "rope_theta": layer["rope_theta"]}
    return layer


def reference_draft_settings(ref: dict) -> dict:
    """What else fixes a weight shape: draft vocabulary (lm_head, d2t), aux layer count (fc), input_norm."""
    eagle = ref.get("eagle_config") or {}
    return {
        "draft_vocab_size": ref.get("draft_vocab_size") or ref["vocab_size"],
        "aux_layer_ids": aux_ids_of(ref),
        "norm_before_fc": bool(ref.get("norm_before_fc", eagle.get("norm_before_fc", VLLM_FLAT_DEFAULTS["norm_before_fc"]))),
    }


def apply_reference(params: RunConfig) -> RunConfig:
    """The run's parameters with the reference's shape-fixing settings; explicit conflicting values are errors."""
    if not params.draft.like:
        return params
    ref = read_reference(params.draft.like)
    want = reference_draft_settings(ref)
    draft, verifier = params.draft.model_copy(), params.verifier.model_copy()
    for section, field, value in ((draft, "draft_vocab_size", want["draft_vocab_size"]),
                                  (verifier, "aux_layer_ids", want["aux_layer_ids"]),
                                  (draft, "norm_before_fc", want["norm_before_fc"])):
        if value is None:
            continue
        current = getattr(section, field)
        if field in section.model_fields_set and current != value:
            raise EagletError(f"{field} is {current} but draft.like {params.draft.like} has {value}: "
                              f"unset it or drop draft.like")
        setattr(section, field, value)
    return params.model_copy(update={"draft": draft, "verifier": verifier})


def check_reference(ref: dict, hidden_size: int, vocab_size: int, like: str) -> None:
    if ref["hidden_size"] != hidden_size:
        raise EagletError(f"draft.like {like} has hidden_size {ref['hidden_size']} but the verifier's is "
                          f"{hidden_size}: EAGLE-3 drafts share the verifier's width")
    if ref["vocab_size"] != vocab_size:
        raise EagletError(f"draft.like {like} has vocab_size {ref['vocab_size']} but the verifier's is {vocab_size}: "
                          "it belongs to another verifier")
