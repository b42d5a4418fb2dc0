"""Batch-1 decoding, the verifier alone against the verifier with the draft, in one process so the two sides can be
interleaved: `python -m bench.decode_pair JOB.json` (a vLLM child process speaking eaglet.vllm.worker's job protocol).

Both engines are built first (same settings; prefix caching off, so every pass computes its prompts), each is
warmed up with full-length batch-1 generations, then the passes alternate: alone, draft, alone, draft, ... Each
pass generates the prompts one at a time; the draft engine's spec-decode counters are read around each of its
passes, so every speedup has the acceptance length of the very tokens it timed.

With job["batched"] ({"conversations", "max_tokens"}; the `check` preset), the same two engines then also give
the batched rows (all conversations at once, one pass each, alone then draft), in the shape of an eaglet.vllm.worker
decode result, instead of one engine per configuration started for them.
"""

from __future__ import annotations

import time


def _engine(job: dict, draft: bool):
    from vllm import LLM

    kwargs = dict(model=job["verifier"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=0,
                  disable_log_stats=False, enforce_eager=True, enable_prefix_caching=False)
    if draft:
        kwargs["speculative_config"] = {"method": job["method"], "model": job["draft"],
                                        "num_speculative_tokens": job["k"]}
    return LLM(**kwargs)


def batched(b: dict, alone, spec) -> dict:
    """All of b["conversations"] in one generate call on each engine (alone, then draft): what eaglet.vllm.worker's
    decode job returns (token_ids per conversation, seconds, tokens_per_s; "spec" counters with the draft)."""
    from vllm import SamplingParams

    from eaglet.vllm.worker import spec_counters, spec_delta

    params = SamplingParams(temperature=0.0, max_tokens=b["max_tokens"], seed=0)
    out = {}
    for name, llm in (("alone", alone), ("draft", spec)):
        llm.chat(b["conversations"][:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # as the job
        before = spec_counters(llm)
        t0 = time.perf_counter()
        outputs = llm.chat(b["conversations"], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = spec_counters(llm)
        ids = [[list(c.token_ids) for c in o.outputs] for o in outputs]
        n = sum(len(t) for per in ids for t in per)
        out[name] = {"token_ids": ids, "seconds": seconds, "output_tokens": n, "tokens_per_s": n / seconds}
        if llm is spec:
            out[name]["spec"] = spec_delta(before, after)
    return out


def run(job: dict) -> dict:
    from vllm import SamplingParams

    from eaglet.vllm.worker import spec_counters, spec_delta

    convs = job["conversations"]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], seed=0)
    t = time.perf_counter()
    alone = _engine(job, False)
    alone_load = time.perf_counter() - t
    t = time.perf_counter()
    spec = _engine(job, True)
    spec_load = time.perf_counter() - t
    for llm in (alone, spec):  # one-off costs of the batch-1 shapes, full length, on both sides
        for conv in convs[: job["warmup"]]:
            llm.chat([conv], params, use_tqdm=False)

    def one_pass(llm):
        before = spec_counters(llm)
        t0, ids = time.perf_counter(), []
        for conv in convs:
            ids += [list(c.token_ids) for o in llm.chat([conv], params, use_tqdm=False) for c in o.outputs]
        seconds = time.perf_counter() - t0
        after = spec_counters(llm)
        n = sum(len(x) for x in ids)
        out = {"seconds": seconds, "tokens": n, "tokens_per_s": n / seconds, "token_ids": ids}
        if llm is spec:
            delta = spec_delta(before, after)
            out.update(drafts=delta["drafts"], accepted=delta["accepted"], accepted_per_pos=delta["accepted_per_pos"])
        return out

    passes = []
    for _ in range(job["repeats"]):
        passes.append({"alone": one_pass(alone), "draft": one_pass(spec)})
    result = {"load_seconds": {"alone": alone_load, "draft": spec_load}, "passes": passes}
    if job.get("batched"):
        result["batched"] = batched(job["batched"], alone, spec)
    return result


if __name__ == "__main__":  # vLLM spawns worker processes: the guard is required
    from eaglet.vllm.worker import serve

    serve(run)
