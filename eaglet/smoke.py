"""vLLM smoke-load: verifier alone and verifier + EAGLE-3 draft, greedy, on held-out prompts.

Reports mean acceptance length (1 + accepted / drafts, at most k + 1), per-position acceptance rates,
whether the outputs are identical (speculative decoding must be lossless at temperature 0), and tokens/s.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from eaglet.data import prompt_part, read_conversations
from eaglet.errors import EagletError
from eaglet.vllm_run import run_vllm_job


class SmokeResult(BaseModel):
    num_speculative_tokens: int
    mean_acceptance_length: float
    acceptance_per_position: list[float]
    lossless: bool
    tokens_per_s_with_draft: float
    tokens_per_s_without_draft: float
    num_prompts: int
    load_seconds_without_draft: float  # each engine's start (weights, KV cache): the smoke-load's own loads
    load_seconds_with_draft: float
    drafts: int
    accepted_tokens: int
    mismatched_prompts: int


LOADER_PACKAGES = {"fastsafetensors": "fastsafetensors", "runai_streamer": "runai_model_streamer"}


def check_load_format(load_format: str) -> None:
    """vLLM's faster loaders need their own packages; say so before an engine starts."""
    from importlib.util import find_spec

    module = LOADER_PACKAGES.get(load_format)
    if module and find_spec(module) is None:
        raise EagletError(f"smoke.load_format={load_format} needs the {module.replace('_', '-')} package "
                          "(pip install it on the GPU host), or use load_format=auto")


def load_prompts(prompts_file: str | Path, num_prompts: int | None = None) -> list[list[dict]]:
    convs = [prompt_part(m) for m in read_conversations(prompts_file)]
    return convs[:num_prompts] if num_prompts else convs


def smoke_test(
    verifier: str, draft: str, prompts: list[list[dict]], k: int = 3, max_tokens: int = 128,
    max_model_len: int = 2048, dtype: str = "float32", load_format: str = "auto",
) -> SmokeResult:
    """dtype: the verifier's compute dtype. In bfloat16 on CPU, verifying k+1 tokens at once rounds differently
    from decoding one, so greedy near-ties flip (15 of 40 SmolLM2 prompts diverged here, 0 in float32):
    float32 makes `lossless` a test of the draft path rather than of bf16 rounding."""
    job = {"verifier": verifier, "conversations": prompts, "max_tokens": max_tokens,
           "max_model_len": max_model_len, "temperature": 0.0, "dtype": dtype, "load_format": load_format}
    check_load_format(load_format)
    base = run_vllm_job(job)
    spec = run_vllm_job(dict(job, draft=str(draft), k=k))
    counts = spec["spec"]
    drafts = counts["drafts"]
    per_pos = [a / drafts if drafts else 0.0 for a in counts["accepted_per_pos"]]
    mismatched = sum(1 for a, b in zip(base["token_ids"], spec["token_ids"]) if a != b)
    return SmokeResult(
        num_speculative_tokens=k,
        mean_acceptance_length=1.0 + counts["accepted"] / drafts if drafts else 1.0,
        acceptance_per_position=per_pos,
        lossless=mismatched == 0,
        tokens_per_s_with_draft=spec["tokens_per_s"],
        tokens_per_s_without_draft=base["tokens_per_s"],
        num_prompts=len(prompts),
        load_seconds_without_draft=base["load_seconds"],
        load_seconds_with_draft=spec["load_seconds"],
        drafts=drafts,
        accepted_tokens=counts["accepted"],
        mismatched_prompts=mismatched,
    )
