"""Regenerate responses with the verifier (vLLM), so the draft learns the verifier's own outputs."""

from __future__ import annotations

from pathlib import Path

from eaglet.data import prompt_part, read_conversations, tools_of, write_conversations
from eaglet.errors import EagletError
from eaglet.vllm import run_job
from eaglet.capture.engine import capture_engine_dtype


def regenerate_responses(
    verifier_path: str,
    conversations_file: Path,
    out_file: Path,
    max_new_tokens: int,
    max_model_len: int,
    temperature: float = 0.0,
    responses_per_prompt: int = 1,
    seed: int = 0,
    progress=None,
    dtype: str = "bfloat16",
) -> dict:
    rows = read_conversations(conversations_file)
    if any(tools_of(msgs) for msgs in rows):  # LLM.chat takes one tool list for a batch; capture renders each row's
        raise EagletError("rows with tools are answered by the vllm capture backend: set extraction.backend=vllm")
    prompts = [prompt_part(msgs) for msgs in rows]
    result = run_job({
        "verifier": verifier_path,
        "conversations": prompts,
        "max_tokens": max_new_tokens,
        "max_model_len": max_model_len,
        "temperature": temperature,
        "n": responses_per_prompt,
        "seed": seed,
        "dtype": dtype,  # the engine's compute dtype
        # sequences per generate call: 256 keeps vLLM's batch full most of the call (64 left it draining at every
        # call's end: 256 prompts x 128 sampled tokens, float32, 2 cores: 297 tokens/s in calls of 64, 442 in one)
        "chunk": max(1, 256 // responses_per_prompt),
    }, progress=progress)
    out_rows = []
    for prompt, texts in zip(prompts, result["texts"]):
        for text in texts:
            if text.strip():
                out_rows.append(prompt + [{"role": "assistant", "content": text}])
    write_conversations(out_file, out_rows)
    return {
        "conversations": len(out_rows),
        "output_tokens": result["output_tokens"],
        "seconds": result["seconds"],
        "tokens_per_s": result["tokens_per_s"],
        "load_seconds": result["load_seconds"],
    }


def regenerate_for_run(verifier, data_dir: str, out_file: Path, cfg, progress=None) -> dict:
    """regenerate_responses with a run's settings: every training row of the data artifact answered."""
    d = cfg.data
    return regenerate_responses(verifier.path, Path(data_dir) / "train.jsonl", out_file, d.max_new_tokens,
                                max_model_len=d.max_seq_len + d.max_new_tokens, temperature=d.temperature,
                                responses_per_prompt=d.responses_per_prompt, seed=d.seed, progress=progress,
                                dtype=capture_engine_dtype(cfg))


def summary(stats: dict) -> str:
    return f"regenerated {stats['output_tokens']} tokens at {stats['tokens_per_s']:.0f} tokens/s"
