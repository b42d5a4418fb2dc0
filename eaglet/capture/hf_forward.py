"""The verifier in Hugging Face transformers: load it, and one forward pass that returns the hidden states
EAGLE-3 trains on. Used by the hf capture backend, in this process or in Dask workers.

Layer convention (vLLM's): aux id k = HF `hidden_states[k]` (0 = embeddings, k = output of decoder layer k-1).
HF's last entry is post-final-norm, vLLM's is not, so the last layer is captured at the input of the final norm.
"""

from __future__ import annotations

import torch

# How many times this process loaded verifier weights. An in-process count for tests; the run report derives
# verifier_loads from which stages ran.
VERIFIER_LOADS = 0


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_hf_model(path: str, device: str, trust_remote_code: bool = False):
    global VERIFIER_LOADS
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    # Kimi-K2.5 and VL verifiers are image-text-to-text models around the language model we read.
    auto = AutoModelForCausalLM
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and hasattr(config, "text_config"):
        auto = AutoModelForImageTextToText
    model = auto.from_pretrained(path, dtype=torch.bfloat16, trust_remote_code=trust_remote_code)
    VERIFIER_LOADS += 1
    return model.to(device).eval()


def final_norm(model) -> torch.nn.Module:
    decoder = model.get_decoder()
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise RuntimeError(f"{type(model).__name__} has no final norm at get_decoder().norm")
    return norm


def pad_batch(batch_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and the attention mask that hides the padding."""
    longest = max(len(x) for x in batch_ids)
    ids = torch.full((len(batch_ids), longest), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, x in enumerate(batch_ids):
        ids[i, : len(x)] = torch.tensor(x)
        attn[i, : len(x)] = 1
    return ids, attn


@torch.inference_mode()
def extract_batch(model, batch_ids: list[list[int]], aux_ids: list[int], pad_id: int) -> list[torch.Tensor]:
    """[T_i, n_aux+1, H] per sequence: aux layers in ascending order, then the pre-norm last layer."""
    device = next(model.parameters()).device
    ids, attn = pad_batch(batch_ids, pad_id)
    captured = {}
    hook = final_norm(model).register_forward_pre_hook(lambda _m, args: captured.__setitem__("last", args[0]))
    try:
        out = model.model(input_ids=ids.to(device), attention_mask=attn.to(device), output_hidden_states=True) \
            if hasattr(model, "model") else model(input_ids=ids.to(device), attention_mask=attn.to(device),
                                                  output_hidden_states=True)
    finally:
        hook.remove()
    layers = [out.hidden_states[k] for k in sorted(aux_ids)] + [captured["last"]]
    stacked = torch.stack(layers, dim=2)  # [B, T, n_aux+1, H]
    return [stacked[i, : len(x)].cpu() for i, x in enumerate(batch_ids)]


def release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


