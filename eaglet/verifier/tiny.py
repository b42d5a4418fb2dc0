"""A tiny random Llama verifier with its own word-level tokenizer and chat template, made locally for tests.

head_dim 64 (vLLM's CPU attention does not support 16), 8 layers so the default aux ids [2, 4, 5] are distinct.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]


def _words(prompts_file: Path) -> list[str]:
    words: dict[str, None] = {}
    for line in prompts_file.read_text().splitlines():
        if line.strip():
            for w in re.findall(r"\w+|[^\w\s]", json.loads(line)["prompt"].lower()):
                words[w] = None
    return ["user", "assistant", "system"] + sorted(words)


def make_tiny_verifier(out: Path, prompts_file: Path, seed: int = 0, num_layers: int = 8) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tokens = list(dict.fromkeys(SPECIALS + _words(prompts_file)))  # de-duplicated, order kept
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<|im_start|>", eos_token="<|im_end|>",
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        bos_token_id=vocab["<|im_start|>"], eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False, initializer_range=0.02, rms_norm_eps=1e-6,
    )
    model = LlamaForCausalLM(config)
    # Large embeddings and a sharp lm_head make the random model's next token depend mostly on recent tokens,
    # with a peaked distribution: structure a one-layer draft can learn in seconds, like a real model's.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(50.0)
        model.lm_head.weight.mul_(10.0)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out
