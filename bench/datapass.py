"""The data pass against its limit: eaglet's `load-verifier` + `generate-and-capture` tasks (the vLLM capture
server, the verifier answering every prompt while the connector saves its hidden states, shards written) against
a bare vLLM server of the same verifier with the same flags minus the capture method and the connector, sent the
same requests (same prompt token ids, max_tokens, temperature, seed, concurrency) by the same kind of client.

Each side starts its own server for each repeat (sides interleaved: pipeline, bare, pipeline, bare, ...) and
stops it after, so start-up is measured as often as the pass. Steady state = generated tokens / the request phase
(pipeline: from the end of its probe request to the last row artifact published; bare: from the first
request to the last answer); start-up = everything else, itemised.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def bare_argv(verifier: str, name: str, max_model_len: int, host: str, port: int) -> list[str]:
    """eaglet's capture server argv (eaglet.capture.engine.server_argv) without the capture method and connector."""
    from eaglet.capture.engine import server_argv

    argv = server_argv(verifier, name, [0], Path("/nonexistent"), max_model_len, host, port)
    for flag in ("--speculative-config", "--kv-transfer-config"):
        i = argv.index(flag)
        del argv[i : i + 2]
    return argv


def start_bare(verifier: str, max_model_len: int, log_file: Path, timeout: float = 1800):
    """The bare server, started as eaglet starts its capture server (same guard process, same environment)."""
    from eaglet.capture.engine import Engine, healthy, free_port, stop_engine
    from eaglet.vllm import vllm_env

    host, port, name = "127.0.0.1", free_port(), "bare"
    t0 = time.perf_counter()
    with log_file.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "eaglet.capture.engine", str(os.getpid()),
                                 *bare_argv(verifier, name, max_model_len, host, port)],
                                stdout=out, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True)
    engine = Engine(endpoint=f"http://{host}:{port}", served_name=name, max_model_len=max_model_len, pid=proc.pid)
    while not healthy(engine.endpoint):
        if proc.poll() is not None or time.perf_counter() - t0 > timeout:
            stop_engine(engine)
            raise RuntimeError(f"the bare vLLM server did not start; see {log_file}")
        time.sleep(0.5)
    engine.load_seconds = time.perf_counter() - t0
    return engine


def bare_pass(engine, tokenizer_path: str, conversations_file: Path, cfg) -> dict:
    """The same requests as eaglet.capture.vllm.generate_and_capture sends, without kv_transfer_params."""
    import httpx
    from transformers import AutoTokenizer

    from eaglet.capture.vllm import IN_FLIGHT, REQUEST_TIMEOUT, chat_prompt_ids, plan_requests
    from eaglet.data import read_conversations

    d = cfg.data
    t_plan = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    requests, _ = plan_requests(tok, read_conversations(conversations_file), True, d.max_seq_len,
                                d.responses_per_prompt)
    first_row: dict[tuple, int] = {}  # eaglet sends a prompt asked twice once (one row artifact): so does the bare side
    requests = [r for r in requests if first_row.setdefault(tuple(r["prompt_ids"]), r["row"]) == r["row"]]
    plan_s = time.perf_counter() - t_plan

    def complete(client, req: dict, max_tokens: int) -> dict:
        body = {"model": engine.served_name, "prompt": req["prompt_ids"], "max_tokens": max_tokens,
                "temperature": d.temperature, "seed": d.seed + req.get("response", 0)}
        r = client.post(f"{engine.endpoint}/v1/completions", json=body)
        r.raise_for_status()
        out = r.json()
        return {"text": out["choices"][0]["text"], "generated": out["usage"]["completion_tokens"]}

    with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=60),
                      limits=httpx.Limits(max_connections=IN_FLIGHT)) as client, ThreadPoolExecutor(IN_FLIGHT) as pool:
        t_warm = time.perf_counter()  # the pipeline's probe: one short prefill before the pass
        complete(client, {"prompt_ids": chat_prompt_ids(tok, [{"role": "user", "content": "hello"}])}, 1)
        warm_s = time.perf_counter() - t_warm
        t0 = time.perf_counter()
        answers = list(pool.map(lambda r: complete(client, r, d.max_new_tokens), requests))
        seconds = time.perf_counter() - t0
    generated = sum(a["generated"] for a in answers)
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "texts": [a["text"] for a in answers], "plan_s": plan_s, "warmup_s": warm_s}


class CaptureClock:
    """Times (never replaces) the pieces of eaglet's data pass in this process."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []

    def wrap(self, owner, attr: str, name: str) -> None:
        orig = getattr(owner, attr)

        @functools.wraps(orig)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.events.append((name, t, time.perf_counter()))

        setattr(owner, attr, timed)

    def install(self) -> None:
        import eaglet.capture.vllm as v
        import eaglet.store as store

        for attr, name in (("probe", "probe"), ("_load", "read connector file"), ("publish_row", "publish row"),
                           ("assemble", "assemble")):
            self.wrap(v, attr, name)
        publish, events = store.publish, self.events

        @functools.wraps(publish)
        def timed_publish(kind, key, build, *args, **kwargs):
            def timed_build(work):
                t = time.perf_counter()
                try:
                    return build(work)
                finally:
                    events.append(("build", t, time.perf_counter()))
            t = time.perf_counter()
            try:
                return publish(kind, key, timed_build, *args, **kwargs)
            finally:
                events.append(("publish", t, time.perf_counter()))

        store.publish = timed_publish

    def take(self) -> list[tuple[str, float, float]]:
        out, self.events[:] = list(self.events), []
        return out


def _total(events, name) -> float:
    return sum(b - a for n, a, b in events if n == name)


def _last(events, name) -> tuple[float, float]:
    return [(a, b) for n, a, b in events if n == name][-1]


def pipeline_pass(home: Path, r: int, info, data_dir: str, cfg, clock: CaptureClock) -> dict:
    """eaglet's two data tasks in the running flow, fresh store (so the pass builds), engine stopped after."""
    from eaglet.capture.engine import stop_for_run
    from tasks import stages as t

    os.environ["EAGLET_HOME"] = str(home / f"dp{r}")
    t0 = time.perf_counter()
    engines = t.load_verifier(info, cfg)
    [engine] = engines  # the bench compares one engine with one bare server
    t1 = time.perf_counter()
    try:
        states = t.generate_and_capture.with_options(refresh_cache=True)(info, data_dir, engines, None, cfg)
        t2 = time.perf_counter()
    finally:
        stop_for_run(engines)
    ev = clock.take()
    stats = json.loads((Path(states) / "stats.json").read_text())
    texts = [json.loads(line)["messages"][-1]["content"]
             for line in (Path(states) / "responses.jsonl").read_text().splitlines()]
    probe = _last(ev, "probe")
    build, publish = _last(ev, "build"), _last(ev, "publish")  # the run's view: the outermost, finished last
    rows = [(a, b) for n, a, b in ev if n == "publish row"]
    window = rows[-1][1] - probe[1]  # from the first request to the last row published
    startup = {
        "engine start (server up)": engine.load_seconds,
        "Prefect load-verifier task around it": (t1 - t0) - engine.load_seconds,
        "Prefect generate-and-capture start + cache key": publish[0] - t1,
        "store: lock, partial dir": build[0] - publish[0],
        "tokenizer, read rows, plan requests, row keys": probe[0] - build[0],
        "probe request": probe[1] - probe[0],
        "assemble the view (links, dataset, token_freq)": _total(ev, "assemble"),
        "responses.jsonl, stats": build[1] - rows[-1][1] - _total(ev, "assemble"),
        "store: manifest + rename": publish[1] - build[1],
        "Prefect task end (result, state)": t2 - publish[1],
    }
    startup["other"] = (t2 - t0) - window - sum(startup.values())
    return {"seconds": window, "generated_tokens": stats["generated_tokens"],
            "tokens_per_s": stats["generated_tokens"] / window, "captured_tokens": stats["extracted_tokens"],
            "in_window": {"read connector files": _total(ev, "read connector file"),
                          "publish rows (write, sha256, rename)": _total(ev, "publish row")},
            "startup_s": sum(startup.values()), "startup_items": startup, "wall_s": t2 - t0, "texts": texts,
            "states": states}


def compare(home: Path, verifier_path: str, data_dir: str, cfg, repeats: int) -> dict:
    """Runs inside a Prefect flow (the tasks need a run context)."""
    from eaglet.verifier import resolve_verifier
    from eaglet.capture.engine import engine_max_model_len

    info = resolve_verifier(verifier_path, cfg.verifier.aux_layer_ids, False)
    clock = CaptureClock()
    clock.install()
    conv_file = Path(data_dir) / "train.jsonl"
    pipe, bare = [], []
    for r in range(repeats):  # interleaved: pipeline, bare, pipeline, bare, ...
        pipe.append(pipeline_pass(home, r, info, data_dir, cfg, clock))
        engine = start_bare(verifier_path, engine_max_model_len(cfg), home / f"bare{r}.log")
        try:
            b = bare_pass(engine, verifier_path, conv_file, cfg)
        finally:
            from eaglet.capture.engine import stop_engine

            stop_engine(engine)
        b["startup_items"] = {"engine start (server up)": engine.load_seconds,
                              "tokenizer, read rows, plan requests": b["plan_s"], "warm-up request": b["warmup_s"]}
        b["startup_s"] = sum(b["startup_items"].values())
        bare.append(b)
    requests = len(bare[0]["texts"])
    same = [sum(x == y for x, y in zip(p["texts"], b["texts"])) / max(1, len(b["texts"])) for p, b in zip(pipe, bare)]
    for x in pipe + bare:
        x.pop("texts")
    return {"pipeline": pipe, "bare": bare, "identical_answers": same, "requests": requests}
