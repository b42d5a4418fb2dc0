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

# A template with a reasoning block and tool calls, after the structure of Qwen3's (and Kimi-K2.5's) chat templates:
# `tools` rendered into the system turn; an assistant turn's reasoning (reasoning_content, or the text before
# </think> in its content) kept only for turns after the last user message (earlier ones are shown without it);
# tool calls as <tool_call> name arguments-as-JSON </tool_call>; tool results as a user turn in <tool_response>;
# the generation prompt opens the reasoning block (thinking on), or closes it empty with enable_thinking=false.
THINKING_TEMPLATE = (
    "{%- if tools %}<|im_start|> system {% if messages[0].role == 'system' %}{{ messages[0].content }} {% endif %}"
    "<tools> {% for t in tools %}{{ t.function.name }} {{ t.function.description or '' }} {% endfor %}</tools> "
    "<|im_end|> {% elif messages and messages[0].role == 'system' %}<|im_start|> system {{ messages[0].content }} "
    "<|im_end|> {% endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|> user {{ m.content }} <|im_end|> "
    "{%- elif m.role == 'assistant' %}{% set content = m.content or '' %}{% set reasoning = m.reasoning_content or '' %}"
    "{%- if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}"
    "{% set content = content.split('</think>')[-1].strip() %}{% endif %}"
    "<|im_start|> assistant {% if loop.index0 > ns.last_query %}<think> {{ reasoning }} </think> {% endif %}"
    "{{ content }}{% for c in m.tool_calls or [] %} <tool_call> {{ c.function.name }} {{ c.function.arguments | tojson }}"
    " </tool_call>{% endfor %} <|im_end|> "
    "{%- elif m.role == 'tool' %}<|im_start|> user <tool_response> {{ m.content }} </tool_response> <|im_end|> "
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|> assistant "
    "{% if enable_thinking is defined and enable_thinking is false %}<think> </think> {% else %}<think> {% endif %}"
    "{%- endif %}"
)
THINKING_SPECIALS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                     "<tools>", "</tools>"]
REASONING = ["let", "me", "see"]  # what the thinking verifier's reasoning block says before </think>


def _words(prompts_file: Path) -> list[str]:
    words: dict[str, None] = {}
    for line in prompts_file.read_text().splitlines():
        if line.strip():
            for w in re.findall(r"\w+|[^\w\s]", json.loads(line)["prompt"].lower()):
                words[w] = None
    return ["user", "assistant", "system"] + sorted(words)


def make_tiny_verifier(out: Path, prompts_file: Path, seed: int = 0, num_layers: int = 8,
                       thinking: bool = False, texts: list[str] = ()) -> Path:
    """thinking: the THINKING_TEMPLATE, its tags as special tokens, and a model whose every answer opens with the
    reasoning block "let me see </think>" (planted in its lm_head); texts: more text whose words join the
    vocabulary (a conversation file's tool calls and results)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    extra = [w for t in texts for w in re.findall(r"\w+|[^\w\s]", t.lower())] + (REASONING if thinking else [])
    specials = SPECIALS + (THINKING_SPECIALS if thinking else [])
    tokens = list(dict.fromkeys(specials + _words(prompts_file) + extra))  # de-duplicated, order kept
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.normalizer = normalizers.Lowercase()
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token="<|im_start|>", eos_token="<|im_end|>",
    )
    tok.add_special_tokens({"additional_special_tokens": specials[2:]})
    tok.chat_template = THINKING_TEMPLATE if thinking else CHAT_TEMPLATE
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
    if thinking:
        _plant_chain(model, tok, ["<think>"] + REASONING + ["</think>"])
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


def _plant_chain(model, tok, chain: list[str], strength: float = 40.0) -> None:
    """Make each token of `chain` the greedy successor of the one before it: the lm_head row of the next token gains
    the part of the final hidden state after the previous token that is its own (the random model's state depends
    mostly on its last token; the part every state shares is projected out, so other contexts are left alone),
    scaled so that its logit there grows by about `strength`."""
    import torch

    ids = [tok.convert_tokens_to_ids(t) for t in chain]
    start = tok.convert_tokens_to_ids("<|im_start|>")
    contexts = [[start, w] for w in range(len(SPECIALS), min(len(tok), 64))]

    def state(last: int):
        return model.model(torch.tensor([c + [last] for c in contexts])).last_hidden_state[:, -1].float().mean(0)

    with torch.no_grad():
        shared = torch.stack([state(t) for t in range(len(SPECIALS), min(len(tok), 48))]).mean(0)
        shared = shared / shared.norm()
        for prev, nxt in zip(ids, ids[1:]):
            d = state(prev)
            d = d - d.dot(shared) * shared
            model.lm_head.weight[nxt] += (strength * d / d.dot(d)).to(model.lm_head.weight.dtype)
