"""vLLM smoke-load: the verifier with the draft (its method given by the draft architecture), greedy, on
held-out prompts, against the verifier alone.

Reports mean acceptance length (1 + accepted / drafts, at most k + 1), per-position acceptance rates,
whether the outputs are identical (speculative decoding must be lossless at temperature 0), and tokens/s.

The verifier alone (its greedy token ids and tokens/s: the baseline) depends only on the verifier, the prompts,
the generation settings and the machine, never on the draft, so it is measured once and kept as an artifact
(`measure_baseline`, or the greedy answers of the data pass's capture engine while it is up: `write_baseline`);
a smoke-load with a new draft then starts one engine, the one with the draft.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

from pydantic import BaseModel

from eaglet.data import chat_ids, prompt_part, read_conversations, reasoning_end, reasoning_tag_ids
from eaglet.errors import EagletError
from eaglet.vllm import run_job

BASELINE_FILE = "baseline.json"
SMOKE_ANSWERS_FILE = "smoke-answers.json"  # the smoke test answered by the evaluation's server (smoke_from_evaluation)


class SmokeResult(BaseModel):
    method: str  # vLLM's speculative method: the draft's architecture (DraftArchitecture.method)
    num_speculative_tokens: int
    mean_acceptance_length: float
    acceptance_per_position: list[float]
    lossless: bool
    tokens_per_s_with_draft: float
    tokens_per_s_without_draft: float
    num_prompts: int
    load_seconds_without_draft: float  # the baseline engine's start (0 when the baseline was reused)
    load_seconds_with_draft: float  # each engine's start: weights, KV cache; the smoke-load's own loads
    baseline_reused: bool = False
    engine: str = "own"  # "evaluation": answered by the evaluation's server at the trained k (no engine of its own)
    baseline_measured: str = ""  # when and where the verifier-alone figures were measured
    drafts: int
    accepted_tokens: int
    mismatched_prompts: int
    # With data.reasoning_tags in the verifier's vocabulary and answers that open with a reasoning block: the share
    # of the verifier's answer tokens that are reasoning, and the draft's acceptance on each part (None otherwise).
    reasoning_share: float | None = None
    acceptance_reasoning: float | None = None
    acceptance_answer: float | None = None


LOADER_PACKAGES = {"fastsafetensors": "fastsafetensors", "runai_streamer": "runai_model_streamer"}


def check_load_format(load_format: str) -> None:
    """vLLM's faster loaders need their own packages; say so before an engine starts."""
    from importlib.util import find_spec

    module = LOADER_PACKAGES.get(load_format)
    if module and find_spec(module) is None:
        raise EagletError(f"smoke.load_format={load_format} needs the {module.replace('_', '-')} package "
                          "(pip install it on the GPU host), or use load_format=auto")


def machine_kind() -> dict:
    """What decides whether two speed measurements are comparable: CPU model, cores, GPUs (names)."""
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = ""
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {"cpu": cpu, "cores": os.cpu_count(), "gpus": gpus, "cuda_visible_devices": visible}


def smoke_max_model_len(cfg) -> int:
    """The longest sequence the smoke test needs: a held-out prompt with smoke.max_tokens of answer."""
    return cfg.data.max_seq_len + cfg.smoke.max_tokens


def load_prompts(prompts_file: str | Path, num_prompts: int | None = None) -> list[list[dict]]:
    convs = [prompt_part(m) for m in read_conversations(prompts_file)]
    return convs[:num_prompts] if num_prompts else convs


def _tokenizer(verifier: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(verifier)


def render_prompts(verifier: str, prompts: list[list[dict]], template_kwargs: dict | None = None) -> list[list[int]]:
    """The held-out prompts as the verifier's template renders them (eaglet.data.chat_ids: their tools,
    data.chat_template_kwargs), as capture renders its prompts: every engine is sent token ids."""
    tok = _tokenizer(verifier)
    return [chat_ids(tok, conv, True, template_kwargs) for conv in prompts]


def whole_answers(prompt_ids: list[list[int]], max_tokens: int) -> list[list[dict]]:
    """One phase: every prompt answered in full (a job's "phases", eaglet.vllm.worker)."""
    return [[{"prompt_ids": ids, "max_tokens": max_tokens} for ids in prompt_ids]]


def split_phases(prompt_ids: list[list[int]], baseline_ids: list[list[int]], max_tokens: int,
                 tag_ids: tuple[int, int] | None) -> tuple[list[list[dict]], list[list[int]] | None]:
    """The draft's smoke phases: where the verifier's answers open with a reasoning block, first each prompt
    answered up to the block's end (max_tokens: its length), then each prompt with its block appended answered on
    (the final answer): two counter readings, acceptance on each part. Greedy decoding is lossless, so the draft's
    path through the reasoning is the verifier's, and the second phase sees the context it would have seen.
    Returns the phases and, per prompt, its reasoning length (None: one phase, no reasoning in any answer)."""
    ends = [reasoning_end(base, ids, tag_ids) for ids, base in zip(prompt_ids, baseline_ids)]
    if not any(ends):
        return whole_answers(prompt_ids, max_tokens), None
    reasoning = [{"prompt_ids": ids, "max_tokens": e} for ids, e in zip(prompt_ids, ends) if e]
    answer = [{"prompt_ids": ids + base[:e], "max_tokens": max_tokens - e}
              for ids, base, e in zip(prompt_ids, baseline_ids, ends) if e < max_tokens]
    return [reasoning, answer], ends


def join_phases(result: dict, ends: list[int] | None, max_tokens: int) -> dict:
    """A phased decode result as one answer per prompt (its reasoning part, then the rest), with each part's
    counters under "split"."""
    if ends is None:
        return result
    reasoning, answer = (iter(p["token_ids"]) for p in result["phases"])
    joined = [[(next(reasoning)[0] if e else []) + (next(answer)[0] if e < max_tokens else [])] for e in ends]
    return result | {"token_ids": joined, "split": {"reasoning": result["phases"][0]["spec"],
                                                    "answer": result["phases"][1]["spec"], "reasoning_tokens": sum(ends)}}


def _job(verifier: str, phases: list[list[dict]], max_model_len: int, dtype: str, load_format: str) -> dict:
    return {"verifier": verifier, "phases": phases, "max_model_len": max_model_len, "temperature": 0.0,
            "dtype": dtype, "load_format": load_format}


def measure_baseline(verifier: str, prompts: list[list[dict]], out: Path, max_tokens: int = 128,
                     max_model_len: int = 2048, dtype: str = "float32", load_format: str = "auto",
                     template_kwargs: dict | None = None) -> dict:
    """The verifier alone on the prompts: greedy token ids, tokens/s, its engine's start; written to
    out/baseline.json with when and on which machine it was measured."""
    check_load_format(load_format)
    phases = whole_answers(render_prompts(verifier, prompts, template_kwargs), max_tokens)
    return write_baseline(out, run_job(_job(verifier, phases, max_model_len, dtype, load_format)))


def write_baseline(out: Path, base: dict, engine: str = "offline") -> dict:
    """out/baseline.json from a verifier-alone result: an offline engine's job (`measure_baseline`), or the
    greedy answers of the data pass's capture engine (engine="capture": no load of its own; its tokens/s is that
    server's batch, with the capture running)."""
    baseline = _baseline(base, engine)
    (out / BASELINE_FILE).write_text(json.dumps(baseline))
    return baseline


def _baseline(base: dict, engine: str = "offline") -> dict:
    """A verifier-alone vLLM job's result as a baseline: what it produced, how fast, by which engine, when and
    where."""
    return {"token_ids": base["token_ids"], "tokens_per_s": base["tokens_per_s"], "seconds": base["seconds"],
            "output_tokens": base["output_tokens"], "load_seconds": base["load_seconds"],
            "num_prompts": len(base["token_ids"]), "engine": engine, "host": socket.gethostname(),
            "machine": machine_kind(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def baseline_summary(b: dict) -> str:
    """A baseline in a log line: which engine, how many prompts, its speed and the machine."""
    engine = "the capture engine, no load of its own" if b.get("engine") == "capture" else "its own engine"
    return (f"verifier alone ({engine}): {b['num_prompts']} held-out prompts, {b['output_tokens']} tokens at "
            f"{b['tokens_per_s']:.0f} tokens/s on {b['machine']['cpu']} {b['machine']['gpus']}".rstrip())


def read_baseline(baseline_dir: str | Path) -> dict:
    return json.loads((Path(baseline_dir) / BASELINE_FILE).read_text())


def smoke_test(
    verifier: str, draft: str, prompts: list[list[dict]], method: str, k: int, max_tokens: int = 128,
    max_model_len: int = 2048, dtype: str = "float32", load_format: str = "auto", baseline: dict | None = None,
    template_kwargs: dict | None = None, reasoning_tags: tuple[str, str] = ("<think>", "</think>"),
) -> SmokeResult:
    """dtype: the verifier's compute dtype. In bfloat16 on CPU, verifying k+1 tokens at once rounds differently
    from decoding one, so greedy near-ties flip (15 of 40 SmolLM2 prompts diverged here, 0 in float32):
    float32 makes `lossless` a test of the draft path rather than of bf16 rounding. baseline: a
    `measure_baseline` result for the same verifier, prompts and settings (else it is measured here)."""
    check_load_format(load_format)
    prompt_ids = render_prompts(verifier, prompts, template_kwargs)
    reused = baseline is not None
    if baseline is None:
        baseline = _baseline(run_job(_job(verifier, whole_answers(prompt_ids, max_tokens), max_model_len, dtype,
                                          load_format)))
    else:
        _check_baseline(baseline, len(prompts))  # before the engine with the draft loads
    phases, ends = split_phases(prompt_ids, [b[0] for b in baseline["token_ids"]], max_tokens,
                                reasoning_tag_ids(_tokenizer(verifier), reasoning_tags))
    spec = run_job(dict(_job(verifier, phases, max_model_len, dtype, load_format), draft=str(draft), k=k,
                        method=method))
    return smoke_result(join_phases(spec, ends, max_tokens), baseline, method, k, reused)


def _check_baseline(baseline: dict, num_prompts: int) -> None:
    if len(baseline["token_ids"]) != num_prompts:
        raise EagletError(f"the baseline has {len(baseline['token_ids'])} prompts, the smoke-load {num_prompts}")


def smoke_result(spec: dict, baseline: dict, method: str, k: int, reused: bool = True,
                 engine: str = "own") -> SmokeResult:
    """The verifier with the draft (a decode result: token ids per prompt, tokens/s, its engine's start and the
    spec-decode counters) against the verifier alone."""
    prompts = spec["token_ids"]
    _check_baseline(baseline, len(prompts))
    counts = spec["spec"]
    drafts = counts["drafts"]
    per_pos = [a / drafts if drafts else 0.0 for a in counts["accepted_per_pos"]]
    mismatched = sum(1 for a, b in zip(baseline["token_ids"], spec["token_ids"]) if a != b)
    split = {}
    if spec.get("split"):
        r, a = spec["split"]["reasoning"], spec["split"]["answer"]
        answer_tokens = sum(len(b[0]) for b in baseline["token_ids"])
        split = {"reasoning_share": spec["split"]["reasoning_tokens"] / answer_tokens if answer_tokens else 0.0,
                 "acceptance_reasoning": 1.0 + r["accepted"] / r["drafts"] if r["drafts"] else None,
                 "acceptance_answer": 1.0 + a["accepted"] / a["drafts"] if a["drafts"] else None}
    return SmokeResult(
        method=method,
        num_speculative_tokens=k,
        mean_acceptance_length=1.0 + counts["accepted"] / drafts if drafts else 1.0,
        acceptance_per_position=per_pos,
        lossless=mismatched == 0,
        tokens_per_s_with_draft=spec["tokens_per_s"],
        tokens_per_s_without_draft=baseline["tokens_per_s"],
        num_prompts=len(prompts),
        load_seconds_without_draft=0.0 if reused else baseline["load_seconds"],
        load_seconds_with_draft=spec["load_seconds"],
        baseline_reused=reused,
        engine=engine,
        baseline_measured=f"{baseline['measured_at']} on {baseline['host']}"
        + (" by the data pass's capture engine" if baseline.get("engine") == "capture" else ""),
        drafts=drafts,
        accepted_tokens=counts["accepted"],
        mismatched_prompts=mismatched,
        **split,
    )


def summary(result: SmokeResult) -> str:
    return (f"{result.method} draft: mean acceptance length {result.mean_acceptance_length:.3f} at "
            f"k={result.num_speculative_tokens}, lossless={result.lossless} (verifier alone measured "
            f"{result.baseline_measured})")


def held_out_prompts(data_dir: str | Path, cfg) -> list[list[dict]]:
    """The smoke test's prompts: the first smoke.num_prompts held-out rows of a run's data artifact."""
    return load_prompts(Path(data_dir) / "eval.jsonl", cfg.smoke.num_prompts)


def baseline_for_run(out: Path, verifier: str, data_dir: str | Path, cfg) -> dict:
    s = cfg.smoke
    return measure_baseline(verifier, held_out_prompts(data_dir, cfg), out, max_tokens=s.max_tokens,
                            max_model_len=smoke_max_model_len(cfg), dtype=s.dtype, load_format=s.load_format,
                            template_kwargs=cfg.data.chat_template_kwargs)


def answers_job(verifier: str, data_dir: str | Path, baseline_dir: str | Path, cfg) -> dict:
    """The smoke test as a job for the evaluation's server with the draft (eaglet.vllm.serving's job["answers"]),
    so that an evaluated run starts no engine of its own for it: its phases (split_phases, from the kept
    baseline), and what joins them again ("ends", "max_tokens")."""
    prompt_ids = render_prompts(verifier, held_out_prompts(data_dir, cfg), cfg.data.chat_template_kwargs)
    baseline = read_baseline(baseline_dir)
    _check_baseline(baseline, len(prompt_ids))
    phases, ends = split_phases(prompt_ids, [b[0] for b in baseline["token_ids"]], cfg.smoke.max_tokens,
                                reasoning_tag_ids(_tokenizer(verifier), cfg.data.reasoning_tags))
    return {"phases": phases, "ends": ends, "max_tokens": cfg.smoke.max_tokens}


def smoke_from_evaluation(evaluation_dir: str | Path, baseline_dir: str | Path, method: str, k: int) -> SmokeResult:
    """The smoke test answered by the evaluation's server at the trained k (evaluate-draft), against the baseline."""
    answers = json.loads((Path(evaluation_dir) / SMOKE_ANSWERS_FILE).read_text())
    answers = join_phases(answers, answers.get("ends"), answers.get("max_tokens", 0))
    return smoke_result(answers | {"load_seconds": 0.0}, read_baseline(baseline_dir), method, k, engine="evaluation")


def smoke_for_run(verifier: str, draft: str, data_dir: str | Path, baseline_dir: str | Path, cfg, method: str,
                  k: int, evaluation_dir: str | Path | None = None) -> SmokeResult:
    """The run's smoke test: method and k are the draft architecture's (DraftArchitecture.method and .k); with
    evaluation_dir, the answers of that evaluation's trained-k server (no engine here)."""
    if evaluation_dir:
        return smoke_from_evaluation(evaluation_dir, baseline_dir, method, k)
    s = cfg.smoke
    return smoke_test(verifier, draft, held_out_prompts(data_dir, cfg), method=method, k=k,
                      max_tokens=s.max_tokens, max_model_len=smoke_max_model_len(cfg), dtype=s.dtype,
                      load_format=s.load_format, baseline=read_baseline(baseline_dir),
                      template_kwargs=cfg.data.chat_template_kwargs, reasoning_tags=cfg.data.reasoning_tags)
