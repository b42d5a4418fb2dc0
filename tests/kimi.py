"""Kimi-K2.5-shaped configs for the tests: the real verifier's config (no weights) and a tiny one with weights.

Kimi-K2.5 is `kimi_k25` (a vision tower + a DeepseekV3 language model) with the language model's fields under
`text_config`; transformers 5.19 ships the config and model classes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# The language-model fields of moonshotai/Kimi-K2.5's config.json (DeepseekV3 / "kimi_k2": MLA attention, MoE).
KIMI_K25_TEXT = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 163840,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "norm_topk_prob": True,
    "max_position_embeddings": 262144, "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "bos_token_id": 163584, "eos_token_id": 163585, "tie_word_embeddings": False,
}
KIMI_K25 = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": KIMI_K25_TEXT, "tie_word_embeddings": False}

# The flat config of a published Kimi draft with the dimensions the converter issue quotes for AQ-MedAI's
# Kimi-K2 EAGLE-3 draft (no hub access here: written from those figures). Its head_dim is 128, not 7168/64.
KIMI_DRAFT_REFERENCE = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 7168,
    "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128, "intermediate_size": 18432,
    "num_hidden_layers": 1, "vocab_size": 163840, "draft_vocab_size": 32000, "rope_theta": 1000000.0,
    "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585,
}


def write_config_only(out: Path, config: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def make_tiny_kimi_verifier(out: Path, prompts_file: Path, seed: int = 0) -> Path:
    """A random Kimi_K25ForConditionalGeneration with an 8-layer DeepseekV3 language model (MoE after layer 1,
    MLA attention), the tiny word-level tokenizer, and `text_config` nesting exactly like the real checkpoint."""
    import torch
    from transformers import AutoTokenizer, Kimi_K25Config, Kimi_K25ForConditionalGeneration

    from eaglet.verifier.tiny import make_tiny_verifier

    make_tiny_verifier(out / "_tok", prompts_file)  # reuse its tokenizer files
    tok = AutoTokenizer.from_pretrained(out / "_tok")
    tok.save_pretrained(out)
    text = dict(
        model_type="deepseek_v3", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=2, vocab_size=len(tok),
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14)
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=32,
                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config)
    with torch.no_grad():  # as the tiny Llama verifier: a peaked distribution a one-layer draft can learn
        model.get_input_embeddings().weight.mul_(50.0)
        model.lm_head.weight.mul_(10.0)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    saved = json.loads((out / "config.json").read_text())
    saved["architectures"] = KIMI_K25["architectures"]  # the name in moonshotai's checkpoint (and vLLM's registry)
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    shutil.rmtree(out / "_tok")
    return out
