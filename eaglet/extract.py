"""Hidden-state extraction with Hugging Face transformers (CPU and GPU), in speculators' on-disk format.

Output directory (speculators `--data-path`):
  data-*.arrow, state.json ...   HF `save_to_disk` dataset with input_ids, loss_mask, seq_len
  hidden_states/hs_{i}.safetensors   hidden_states [T, n_aux+1, H] (aux layers ascending, then the last
                                     layer, all pre-final-norm) and token_ids [T]
  token_freq.pt                  {token_id: count} over loss-masked tokens

Layer convention (vLLM's): aux id k = HF `hidden_states[k]` (0 = embeddings, k = output of decoder layer k-1).
HF's last entry is post-final-norm, vLLM's is not, so the last layer is captured at the input of the final norm.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglet.data import read_conversations, tokenize_conversations

EXTRACTOR_VERSION = "hf-1"

# How many times this process loaded verifier weights. An in-process count for tests; the run report derives
# verifier_loads from which artifacts the run built (store.published_since).
VERIFIER_LOADS = 0


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_verifier(path: str, device: str, trust_remote_code: bool = False):
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


@torch.inference_mode()
def extract_batch(model, batch_ids: list[list[int]], aux_ids: list[int], pad_id: int) -> list[torch.Tensor]:
    """[T_i, n_aux+1, H] per sequence: aux layers in ascending order, then the pre-norm last layer."""
    device = next(model.parameters()).device
    longest = max(len(x) for x in batch_ids)
    ids = torch.full((len(batch_ids), longest), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, x in enumerate(batch_ids):
        ids[i, : len(x)] = torch.tensor(x)
        attn[i, : len(x)] = 1
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


def extract_hidden_states(
    verifier_path: str,
    conversations_file: Path,
    out: Path,
    aux_ids: list[int],
    max_seq_len: int,
    batch_size: int,
    dtype: str = "bfloat16",
    device: str = "auto",
    trust_remote_code: bool = False,
    progress=None,
) -> dict:
    """Tokenize the conversations, run the verifier, and write everything speculators' trainer reads."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier_path, trust_remote_code=trust_remote_code)
    rows = read_conversations(conversations_file)
    samples, freq = tokenize_conversations(tok, rows, max_seq_len)
    torch.save(dict(freq), out / "token_freq.pt")
    ds = Dataset.from_list(samples)
    ds.set_format("torch")
    ds.save_to_disk(str(out))

    model = load_verifier(verifier_path, resolve_device(device), trust_remote_code)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    store_dtype = getattr(torch, dtype)
    hs_dir = out / "hidden_states"
    hs_dir.mkdir()
    order = sorted(range(len(samples)), key=lambda i: -samples[i]["seq_len"])  # less padding per batch
    done_tokens, t0 = 0, time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        states = extract_batch(model, [samples[i]["input_ids"] for i in idx], aux_ids, pad_id)
        for i, hs in zip(idx, states):
            save_file(
                {"hidden_states": hs.to(store_dtype).contiguous(),
                 "token_ids": torch.tensor(samples[i]["input_ids"], dtype=torch.long)},
                str(hs_dir / f"hs_{i}.safetensors"),
            )
            done_tokens += samples[i]["seq_len"]
        if progress:
            progress(min(b + batch_size, len(order)), len(order), done_tokens / (time.perf_counter() - t0))
    seconds = time.perf_counter() - t0
    hidden_size = model.config.get_text_config().hidden_size
    del model
    return {
        "samples": len(samples),
        "tokens": done_tokens,
        "loss_tokens": sum(freq.values()),
        "seconds": seconds,
        "tokens_per_s": done_tokens / seconds if seconds else 0.0,
        "bytes_per_token": (len(aux_ids) + 1) * hidden_size * store_dtype.itemsize,
    }


def token_freq(path: Path) -> Counter:
    return Counter(torch.load(path / "token_freq.pt", weights_only=True))
