"""vLLM's flat EAGLE-3 form (`LlamaForCausalLMEagle3`, as vLLM's `llama_eagle3.py` reads it): its names, the
decoder fields it reads, and what each format assumes when a norm flag is absent."""

from __future__ import annotations

FLAT_ARCH = "LlamaForCausalLMEagle3"
FLAT_ARCHS = (FLAT_ARCH, "Eagle3LlamaForCausalLM")
LAYER_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "rms_norm_eps", "max_position_embeddings", "attention_bias", "attention_dropout", "mlp_bias",
    "rope_parameters", "rope_theta", "rope_scaling", "layer_types", "sliding_window", "use_sliding_window",
    "initializer_range", "pretraining_tp",
)
SAFETENSORS_TO_TORCH = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}  # the flat config's dtype
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# What each format assumes when a flag is absent: speculators' Eagle3SpeculatorConfig vs vLLM's flat loader.
SPECULATORS_DEFAULTS = {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
VLLM_FLAT_DEFAULTS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


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
