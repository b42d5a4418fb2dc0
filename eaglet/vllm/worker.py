"""vLLM in a child process: `python -m eaglet.vllm.worker JOB.json` (eaglet.vllm.run.run_job starts it).

vLLM spawns workers and holds most of the machine's memory, so eaglet never imports it in the orchestrating
process. A job is a JSON file; the result is written to job["out"] as JSON.

Modes:
  generate: answer conversations with the verifier (regeneration).
  decode:   generate greedily on prompts, optionally with a draft (job["method"]), and read the spec-decode counters.
            job["phases"] (lists of {"prompt_ids", "max_tokens"}: prompts rendered by eaglet.data.chat_ids) in
            place of conversations: the phases run one after the other, each with its own counters (the smoke
            test's reasoning and final-answer parts).
Options: "chunk" (conversations per generate call), "warmup" (one short generation first), "batch1" (then
time the first N conversations one at a time).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

from eaglet.data import row_digest  # a conversation's identity, as the data stage keys it

PROGRESS = "eaglet-progress:"


def _engine(job: dict):
    from vllm import LLM

    kwargs = dict(
        model=job["verifier"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=job.get("max_model_len", 2048),
        seed=job.get("seed", 0),
        disable_log_stats=False,
        enforce_eager=job.get("enforce_eager", True),
    )
    if job.get("draft"):
        kwargs["speculative_config"] = {
            "method": job["method"],  # never let vLLM guess it from the directory name
            "model": job["draft"],
            "num_speculative_tokens": job["k"],
        }
    for knob in ("max_num_batched_tokens", "max_num_seqs"):  # the scheduler's per-step budget (vLLM's defaults)
        if knob in job:
            kwargs[knob] = job[knob]
    if "gpu_memory_utilization" in job:
        kwargs["gpu_memory_utilization"] = job["gpu_memory_utilization"]
    if job.get("load_format", "auto") != "auto":
        kwargs["load_format"] = job["load_format"]
    return LLM(**kwargs)


def request_seeds(job: dict) -> list[int | None]:
    """The sampling seed of each conversation (vLLM gives its n answers seed, seed + 1, ...). Sampled answers get
    a seed of their own per conversation, from the job's seed and the conversation: vLLM seeds each request's
    generator with its seed, so one seed for every request would give every prompt the same noise at each step
    (eaglet.capture.vllm.sample_seed). None on vLLM's CPU backend when sampling: vLLM 0.32's model runner
    rewinds a seeded request's generator (`set_offset`, gpu_model_runner) after every partial prefill, and torch's
    CPU generator has no offset ("CPU Generator does not use offset"), so the first seeded request prefilled in
    chunks kills a CPU engine (a batch of 1,840 sampled answers died within a minute). Unseeded requests draw from
    the engine's generator, seeded by LLM(seed=...), each its own noise. Greedy answers draw nothing."""
    from vllm.platforms import current_platform

    convs, seed = job["conversations"], job.get("seed", 0)
    if job.get("temperature", 0.0) <= 0:
        return [seed] * len(convs)
    if current_platform.is_cpu():
        return [None] * len(convs)
    return [conversation_seed(seed, conv) for conv in convs]


def conversation_seed(seed: int, conversation: list[dict]) -> int:
    text = f"{seed}/{row_digest(conversation)}"
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) & 0x3FFFFFFF  # room for seed + i below 2**31


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters so far (cumulative; spec_delta gives what one pass added)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in llm.get_metrics():
        name = m.name
        if name == "vllm:spec_decode_num_drafts":
            out["drafts"] = int(m.value)
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = [int(v) for v in m.values]
    return out


def spec_delta(before: dict, after: dict) -> dict:
    """What the passes between two spec_counters readings drafted and accepted (per position too)."""
    per_pos_before = before["per_pos"] or [0] * len(after["per_pos"])
    return {"drafts": after["drafts"] - before["drafts"], "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"],
            "accepted_per_pos": [a - b for a, b in zip(after["per_pos"], per_pos_before)]}


def run_phases(llm, job: dict, load_seconds: float) -> dict:
    """Token-id prompts, phase by phase: each phase's answers, seconds and spec-decode counters; the result's
    token_ids are every phase's answers in order, and its spec the sum."""
    from vllm import SamplingParams, TokensPrompt

    phases, total_seconds, token_ids = [], 0.0, []
    for phase in job["phases"]:
        prompts = [TokensPrompt(prompt_token_ids=p["prompt_ids"]) for p in phase]
        params = [SamplingParams(temperature=0.0, max_tokens=p["max_tokens"]) for p in phase]
        before, t0 = spec_counters(llm), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False) if phase else []
        seconds = time.perf_counter() - t0
        ids = [[list(c.token_ids) for c in o.outputs] for o in outputs]
        phases.append({"token_ids": ids, "seconds": seconds, "spec": spec_delta(before, spec_counters(llm))})
        total_seconds += seconds
        token_ids += ids
    n_tokens = sum(len(t[0]) for t in token_ids)
    result = {"token_ids": token_ids, "seconds": total_seconds, "output_tokens": n_tokens,
              "tokens_per_s": n_tokens / total_seconds if total_seconds else 0.0, "load_seconds": load_seconds,
              "phases": phases}
    if job.get("draft"):
        result["spec"] = sum_spec([p["spec"] for p in phases])
    return result


def sum_spec(deltas: list[dict]) -> dict:
    width = max((len(d["accepted_per_pos"]) for d in deltas), default=0)
    return {"drafts": sum(d["drafts"] for d in deltas), "draft_tokens": sum(d["draft_tokens"] for d in deltas),
            "accepted": sum(d["accepted"] for d in deltas),
            "accepted_per_pos": [sum(d["accepted_per_pos"][i] if i < len(d["accepted_per_pos"]) else 0
                                     for d in deltas) for i in range(width)]}


def run(job: dict) -> dict:
    from vllm import SamplingParams

    t_load = time.perf_counter()
    llm = _engine(job)
    load_seconds = time.perf_counter() - t_load  # the engine's start: weights, KV cache, warm-up of the runner
    if "phases" in job:
        return run_phases(llm, job, load_seconds)
    convs = job["conversations"]
    params = [SamplingParams(n=job.get("n", 1), temperature=job.get("temperature", 0.0), max_tokens=job["max_tokens"],
                             seed=seed) for seed in request_seeds(job)]
    if job.get("warmup"):  # the first generation pays one-off costs that are not decoding speed
        llm.chat(convs[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    before = spec_counters(llm)
    t0 = time.perf_counter()
    # Chunks large enough to keep vLLM's batch full, small enough to report progress on long runs.
    chunk = max(1, job.get("chunk") or len(convs))
    outputs, done = [], 0
    for start in range(0, len(convs), chunk):
        new = llm.chat(convs[start : start + chunk], params[start : start + chunk], use_tqdm=False)
        outputs += new
        done += sum(len(c.token_ids) for o in new for c in o.outputs)
        report(len(outputs), len(convs), done, done / (time.perf_counter() - t0))
    seconds = time.perf_counter() - t0
    after = spec_counters(llm)
    texts = [[c.text for c in o.outputs] for o in outputs]
    token_ids = [[list(c.token_ids) for c in o.outputs] for o in outputs]
    n_tokens = sum(len(t) for per in token_ids for t in per)
    result = {
        "texts": texts,
        "token_ids": token_ids,
        "seconds": seconds,
        "output_tokens": n_tokens,
        "tokens_per_s": n_tokens / seconds if seconds else 0.0,
        "load_seconds": load_seconds,
    }
    if job.get("draft"):
        result["spec"] = spec_delta(before, after)
    if job.get("batch1"):  # then the first N conversations one at a time: batch-1 latency-bound decoding
        t1, n1 = time.perf_counter(), 0
        for conv, p in zip(convs[: job["batch1"]], params):
            n1 += sum(len(c.token_ids) for o in llm.chat([conv], p, use_tqdm=False) for c in o.outputs)
        s1 = time.perf_counter() - t1
        result["batch1"] = {"seconds": s1, "output_tokens": n1, "tokens_per_s": n1 / s1 if s1 else 0.0}
    return result


def report(done: int, total: int, tokens: int, tokens_per_s: float) -> None:
    print(PROGRESS, json.dumps({"done": done, "total": total, "tokens": tokens, "tokens_per_s": tokens_per_s}),
          flush=True)


def serve(run_job_fn) -> None:
    """The job protocol of a vLLM child process (`python -m MODULE JOB.json`): read the job, run it, write the
    result atomically to job["out"] (run_job reads it; progress goes to stdout as PROGRESS lines)."""
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = run_job_fn(job)
    tmp = job["out"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, job["out"])


if __name__ == "__main__":  # vLLM spawns worker processes: the guard is required
    serve(run)
