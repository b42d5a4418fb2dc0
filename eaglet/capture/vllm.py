"""The vllm capture backend: one pass through a capture engine (eaglet.capture.engine) makes the training data.

With regeneration, each request is a prompt (the verifier's chat template applied here, so the token ids are the
ones the engine sees) answered by the verifier, with `include_output_tokens`: the engine saves the hidden states
of prompt + response (all tokens but the last generated one, which was never an input). The sample is those
token ids, with the loss on the response; its states are the ones computed while generating (they equal a
prefill of the same ids to bf16 rounding: tests/test_capture_vllm.py). Without regeneration each request is a
whole conversation, prefill-only (one generated token, discarded), with the assistant-only loss mask.

Each conversation is a row artifact (eaglet.capture.rows), published as soon as its requests finish; only rows
the store does not hold reach the engine (a file that grew by N rows costs N rows), and the requests of many rows
are in flight at once so the engine's batches stay full. A killed pass loses only the rows in flight. The
run's dataset is then assembled from the rows, in row order, as links.
"""

from __future__ import annotations

import hashlib
import os
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from eaglet.capture.engine import Engine, EngineError, healthy
from eaglet.capture.fleet import EngineGone, Fleet, describe_shares
from eaglet.capture.rows import (assemble, have_row, have_streamed_row, publish_row, publish_streamed_row, read_row,
                                 row_bytes, row_key, row_path, set_view_content, turn_key)
from eaglet.capture.shards import bytes_per_token, get_text_hidden_size
from eaglet.data import (assistant_mask, chat_ids, chat_messages, check_rendering, check_template_settings,
                         prompt_part, read_conversations, reasoning_flags, reasoning_tag_ids, tools_of)
from eaglet.errors import EagletError
from eaglet.capture import CAPTURE_VERSIONS
from eaglet.capture.engine import capture_engine_dtype, capture_layers
from eaglet.verifier import resolve_verifier
from eaglet.evaluate.smoke import held_out_prompts, write_baseline

log = logging.getLogger("eaglet.capture")

IN_FLIGHT = 256  # requests in flight: vLLM batches them (its default max_num_seqs); the rest wait here
# A request waits in vLLM's queue behind at most IN_FLIGHT others; one silent for this long means a stuck engine.
REQUEST_TIMEOUT = 1800.0


def chat_prompt_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    return chat_ids(tokenizer, messages, True, template_kwargs)


def answer_positions(messages: list[dict]) -> list[int]:
    """Where the verifier answers under data.regenerate_turns=all: each assistant turn, and the end of a
    conversation that does not end with one."""
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return at + ([len(messages)] if not at or at[-1] != len(messages) - 1 else [])


def plan_requests(tokenizer, rows: list[list[dict]], regenerate: bool, max_seq_len: int,
                  responses_per_prompt: int = 1, turns: str = "last",
                  template_kwargs: dict | None = None) -> tuple[list[dict], int]:
    """One request per sample, numbered in row order: prompt ids, and for prefill the loss mask. Rows that
    cannot give a trainable token are left out here, before any work (counted). With turns "all", a row's first
    answer is a request like any other and each later one ("turn" t) carries its context: the data's messages
    before it ("context"), whose assistant turns at "answered" the pass replaces by the verifier's answers before
    rendering its prompt."""
    requests, skipped = [], 0
    for row, msgs in enumerate(rows):
        if regenerate:
            at = answer_positions(msgs) if turns == "all" else [len(prompt_part(msgs))]
            ids = chat_prompt_ids(tokenizer, msgs[: at[0]], template_kwargs)
            if len(ids) >= max_seq_len:  # no room for a response token
                skipped += 1
                continue
            requests += [{"row": row, "prompt_ids": ids, "response": j} for j in range(responses_per_prompt)]
            requests += [{"row": row, "turn": t, "response": 0, "context": msgs[: at[t]], "answered": at[:t],
                          "inputs": msgs[at[t - 1] + 1: at[t]]} for t in range(1, len(at))]
        else:
            ids, mask = assistant_mask(tokenizer, msgs, max_seq_len, template_kwargs)
            if sum(mask) == 0:
                skipped += 1
                continue
            requests.append({"row": row, "prompt_ids": ids, "loss_mask": mask})
    if not requests:
        raise EagletError("no row keeps a trainable token within data.max_seq_len; raise data.max_seq_len")
    return requests, skipped


def _post(client, url: str, body: dict, attempts: int = 3):
    """POST, sent again when the server dropped the connection before answering. uvicorn closes a keep-alive
    connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE idle seconds; a request sent on it at that instant ends in
    "Server disconnected without sending a response" (seen in CI, under load). A request is idempotent: same ids,
    same per-request seed, its states in a file of its own."""
    import httpx

    for attempt in range(attempts):
        try:
            return client.post(url, json=body)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            if attempt == attempts - 1:
                raise


def _complete(client, engine: Engine, req: dict, gen: dict | None) -> dict:
    """One request; returns the response text, the captured file's path and the generated token count."""
    body = {"model": engine.served_name, "prompt": req["prompt_ids"], "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {}}
    if gen:
        body.update(max_tokens=gen["max_new_tokens"], temperature=gen["temperature"],
                    seed=req["seed"], kv_transfer_params={"include_output_tokens": True})
    r = _post(client, f"{engine.endpoint}/v1/completions", body)
    if r.status_code >= 500:  # the engine, not the request: another engine of the fleet takes it
        raise EngineGone(f"the verifier engine at {engine.endpoint} answered {r.status_code}: {r.text[:300]}")
    if r.status_code != 200:
        raise EngineError(f"the verifier engine answered {r.status_code}: {r.text[:500]}")
    out = r.json()
    path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise EagletError(f"the engine at {engine.endpoint} returned no hidden states: it was not started with the "
                          "extract_hidden_states method and the hidden-states connector (`eaglet verifier serve`)")
    return {"text": out["choices"][0]["text"], "path": path,
            "generated": out.get("usage", {}).get("completion_tokens", 0)}


def _sent(fleet: Fleet, client, req: dict, gen: dict | None, turn_prompt=None) -> dict:
    """One request through the fleet: the answer, with the index of the engine that gave it. A later turn's
    prompt is rendered first, by turn_prompt (it waits for the earlier answers); None: no room left in
    data.max_seq_len, and nothing is sent."""
    if "turn" in req:
        ids = turn_prompt(req)
        if ids is None:
            return {"text": None, "path": None, "generated": 0, "engine": None, "prompt_ids": None}
        req = dict(req, prompt_ids=ids)
    i, answer = fleet.call(lambda engine: _complete(client, engine, req, gen))
    return dict(answer, engine=i, prompt_ids=req["prompt_ids"])


def _answer(future, poll: float = 10.0) -> dict:
    """future.result(), waited for in short timed waits: a pass has been seen standing still at one row while every
    later request had been answered, until a profiler attached to the client process woke it; a timed wait looks
    again by itself. (httpx's REQUEST_TIMEOUT still bounds the request.)"""
    while True:
        try:
            return future.result(timeout=poll)
        except TimeoutError:
            continue


def _answer_and_states(fleet: Fleet, future, pool, client, req: dict, gen: dict | None,
                       turn_prompt=None) -> tuple[dict, dict | None]:
    """A request's answer and its hidden states. An engine that died after answering may have left its file
    half-written (its write lock goes with the process): that engine is taken out and the request sent again."""
    while True:
        answer = _answer(future)
        if answer["path"] is None:  # a later turn with no room left: nothing was sent
            return answer, None
        try:
            return answer, _load(answer["path"])
        except Exception:
            if healthy(fleet.engines[answer["engine"]].endpoint):
                raise
            fleet.take_out(answer["engine"], "stopped after answering; its hidden-state file was left unreadable")
        future = pool.submit(_sent, fleet, client, req, gen, turn_prompt)


def _load(path: str) -> dict:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )

    if not Path(path).is_file() and not Path(path + ".lock").is_file():
        raise EagletError(f"the engine saved hidden states at {path}, which this machine cannot read: the engine's "
                          "storage directory must be shared, at the same path")
    saved = load_hidden_states(path)  # waits for the connector's write
    cleanup_hidden_states(path)
    return saved


def probe(engine: Engine, tokenizer, layers: int) -> None:
    """One short prefill before the pass: the engine captures, its files are readable here, with `layers` layers."""
    import httpx

    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "hello"}])
    with httpx.Client(timeout=600) as client:
        got = _load(_complete(client, engine, {"prompt_ids": ids}, None)["path"])
    if got["hidden_states"].shape[1] != layers or got["token_ids"].tolist() != ids:
        raise EagletError(f"the engine at {engine.endpoint} captures {got['hidden_states'].shape[1]} layers for "
                          f"{got['token_ids'].shape[0]} tokens; this run needs {layers} for {len(ids)}")


def _sample(req: dict, saved: dict, max_seq_len: int, regenerate: bool) -> tuple[list[int], list[int], object]:
    """req: the request as sent (a later turn's with its rendered prompt_ids)."""
    ids = saved["token_ids"].tolist()
    if ids[: len(req["prompt_ids"])] != req["prompt_ids"]:
        raise EngineError(f"the engine's token ids for row {req['row']} do not start with its prompt")
    ids, states = ids[:max_seq_len], saved["hidden_states"][:max_seq_len]
    n_prompt = len(req["prompt_ids"])
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt) if regenerate else req["loss_mask"][: len(ids)]
    return ids, mask, states


def capture_settings(layers: list[int], max_seq_len: int, dtype: str, regenerate: bool, max_new_tokens: int,
                     temperature: float, responses_per_prompt: int, seed: int, engine_dtype: str = "bfloat16",
                     turns: str = "last", template_kwargs: dict | None = None) -> dict:
    """Everything besides the verifier and the request that decides a row's bytes (part of its key). layers: the
    captured vLLM layer ids (eaglet.capture.engine.capture_layers), not their count: rows of aux [2, 15, 27] are
    not the states of aux [8, 15, 27]. turns and template_kwargs (data.regenerate_turns, chat_template_kwargs)
    are the plan's: they enter the key only when set (a later turn's prompt is rendered with them), so rows
    captured before they existed keep their keys."""
    gen = {"max_new_tokens": max_new_tokens, "temperature": temperature, "n": responses_per_prompt, "seed": seed}
    settings = {"layers": list(layers), "max_seq_len": max_seq_len, "dtype": dtype,
                "generation": gen if regenerate else None, "engine_dtype": engine_dtype,
                "version": CAPTURE_VERSIONS["vllm-sampled" if regenerate and temperature > 0 else "vllm"]}
    return settings | ({"template_kwargs": template_kwargs} if template_kwargs else {}) \
        | ({"turns": turns} if turns != "last" and regenerate else {})


def run_capture_settings(verifier, cfg) -> dict:
    """capture_settings for a run: a VerifierInfo and a RunConfig."""
    d = cfg.data
    return capture_settings(capture_layers(verifier.aux_layer_ids, verifier.num_layers), d.max_seq_len,
                            cfg.extraction.dtype, d.regenerate, d.max_new_tokens, d.temperature,
                            d.responses_per_prompt, d.seed, capture_engine_dtype(cfg), d.regenerate_turns,
                            d.chat_template_kwargs)


def write_plan(path: Path, planned: dict[str, list[dict]], skipped: int) -> None:
    """plan_rows' result, kept for the pass that sends it (the rows are tokenized once per run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"planned": planned, "skipped": skipped}))
    os.replace(tmp, path)


def read_plan(path: Path) -> tuple[dict[str, list[dict]], int]:
    plan = json.loads(Path(path).read_text())
    return plan["planned"], plan["skipped"]


def plan_rows(tokenizer_path: str, conversations_file: Path, fingerprint: str, settings: dict,
              trust_remote_code: bool = False) -> tuple[dict[str, list[dict]], int]:
    """{row key: its requests} in row order (a row asked twice is one key), and the rows left out."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    gen = settings["generation"]
    rows = read_conversations(conversations_file)
    template_kwargs = settings.get("template_kwargs") or {}
    check_rendering(tok, rows, template_kwargs, str(conversations_file))  # before any load
    requests, skipped = plan_requests(tok, rows, gen is not None, settings["max_seq_len"], gen["n"] if gen else 1,
                                      settings.get("turns", "last"), template_kwargs)
    by_sample: dict[tuple, list[dict]] = {}
    for req in requests:
        by_sample.setdefault((req["row"], req.get("turn", 0)), []).append(req)
    planned: dict[str, list[dict]] = {}
    previous: dict[int, str] = {}  # a row's latest turn's key, and those of all its earlier turns
    earlier: dict[int, list[str]] = {}
    for (row, turn), reqs in by_sample.items():  # the responses of a row share its request, hence its key
        key = row_key(fingerprint, settings, reqs[0]) if turn == 0 else turn_key(previous[row], reqs[0]["inputs"])
        if turn:
            reqs = [dict(req, answer_keys=list(earlier[row])) for req in reqs]
        previous[row], earlier[row] = key, earlier.get(row, []) + [key]
        if key not in planned:  # a sampled answer's seed; prefill requests sample nothing
            planned[key] = [dict(req, seed=sample_seed(key, req["response"])) for req in reqs] if gen else reqs
    return planned, skipped


def sample_seed(key: str, response: int) -> int:
    """The sampling seed of a row's answer `response`: its own for every row and answer. vLLM seeds each request's
    generator with its seed, so two requests with one seed draw the same noise at every step; with `seed +
    response`, answer j of every prompt shared one noise sequence (in the sampled x2 capture, answers of two prompts
    with one seed held the same token at a position 28% more often than with two seeds, 1.34% against 1.05% from
    position 3 on). The row key holds the run's seed and the prompt, so an answer does not depend on where its row
    sits in the data file (nightly runs append rows)."""
    return int(hashlib.sha256(f"{key}/{response}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def rows_to_compute(planned: dict[str, list[dict]]) -> list[str]:
    return [key for key in planned if not have_row(key)]


def decide_rows(planned: dict[str, list[dict]], regenerate: bool, states: str = "keep",
                budget_bytes: int | None = None, token_bytes: int = 0) -> dict[str, list[str]]:
    """Which rows the pass computes and which are streamed (extraction.states, extraction.disk_budget_gb). A row
    kept in the store is used as it is. Otherwise, under `states` keep with no budget, it is computed and kept;
    under stream (or past the budget) only its token ids are kept: the engine computes it only when its answer is
    still to be generated. Under a budget, a row whose length is known (prefill, or an answer kept earlier) is
    kept while the budget holds it, in row order; a new answer's length is known only once generated, so such
    rows are computed and `pending`: kept if what the budget has left holds them when they arrive. The budget
    counts every kept row the view links (estimated as the pass does), an earlier run's included: a rerun keeps
    nothing more.
    Returns lists of keys, in row order: keep, pending, stream_compute (answers only), stream_plan (prefill, ids
    from the plan, no engine), streamed_known (token ids already in the store); and the budget's bytes left
    after `keep`."""
    out = {name: [] for name in ("keep", "pending", "stream_compute", "stream_plan", "streamed_known")}
    kept = {key for key in planned if have_row(key)}
    left = budget_bytes
    if left is not None:
        left -= sum(row_estimate(sum(s["tokens"] for s in samples), len(samples), token_bytes)
                    for samples in (read_row(key)["samples"] for key in kept))
    for key, reqs in planned.items():
        if key in kept:
            continue
        if states == "keep" and budget_bytes is None:
            out["keep"].append(key)
            continue
        known = have_streamed_row(key)
        tokens = (sum(s["tokens"] for s in read_row(key, streamed=True)["samples"]) if known
                  else None if regenerate else sum(len(r["prompt_ids"]) for r in reqs))
        if states == "keep" and tokens is None:
            out["pending"].append(key)
        elif states == "keep" and row_estimate(tokens, len(reqs), token_bytes) <= left:
            left -= row_estimate(tokens, len(reqs), token_bytes)
            out["keep"].append(key)
        elif known:
            out["streamed_known"].append(key)
        else:
            out["stream_compute" if regenerate else "stream_plan"].append(key)
    return out, left


def row_estimate(tokens: int, samples: int, token_bytes: int) -> int:
    """A kept row's bytes on disk, from above: its states, its int64 token ids and a safetensors header each."""
    return tokens * (token_bytes + 8) + 1024 * samples


def check_budget(planned: dict[str, list[dict]], budget_bytes: int, token_bytes: int) -> None:
    """A budget that cannot hold the shortest new row (its prompt alone) would keep nothing: one sentence."""
    new = [sum(len(r.get("prompt_ids", [])) for r in reqs) for key, reqs in planned.items()
           if not have_row(key) and "turn" not in reqs[0]]  # a later turn's prompt is longer than its first's
    if new and row_estimate(min(new), 1, token_bytes) > budget_bytes:
        need = row_estimate(min(new), 1, token_bytes)
        raise EagletError(f"extraction.disk_budget_gb={budget_bytes / 1e9:g} holds no row: the shortest new row "
                          f"needs {need / 1e9:.3g} GB ({min(new)} tokens at {token_bytes} bytes each); raise it, or "
                          "set extraction.states=stream to keep no states")


def generate_and_capture(engines: Engine | list[Engine] | None, tokenizer_path: str, conversations_file: Path,
                         out: Path, layers: list[int], max_seq_len: int, dtype: str = "bfloat16",
                         regenerate: bool = True, max_new_tokens: int = 128, temperature: float = 0.0,
                         responses_per_prompt: int = 1,
                         seed: int = 0, trust_remote_code: bool = False, progress=None,
                         fingerprint: str | None = None, engine_dtype: str = "bfloat16",
                         plan: Path | None = None, states: str = "keep", budget_bytes: int | None = None,
                         turns: str = "last", template_kwargs: dict | None = None,
                         reasoning_tags: tuple[str, str] = ("<think>", "</think>"),
                         reasoning_in_loss: bool = True) -> dict:
    """Fill `out` with the dataset view of every row of `conversations_file` (eaglet.capture.rows), sending to
    `engines` only the rows the store does not hold yet; each is published as its requests finish, so a killed
    pass loses only the rows in flight. `engines` (one or several: eaglet.capture.fleet deals the requests and
    fails over) may be None when every row is known; else each captures `layers` (vLLM ids,
    eaglet.capture.engine.capture_layers). responses.jsonl keeps the verifier's answers.
    progress(rows done, rows to compute, tokens/s). plan: plan_rows' result for these settings (write_plan), when
    the run has already tokenized the rows to decide whether to load the verifier. states / budget_bytes:
    extraction.states and extraction.disk_budget_gb (decide_rows): a streamed row keeps only its token ids, and
    the view links no states for it. turns, template_kwargs: data.regenerate_turns and chat_template_kwargs (a
    later turn is sent once the answers before it are published, and its prompt rendered from them);
    reasoning_tags / reasoning_in_loss: what the view's loss masks leave out, and the reasoning share."""
    import httpx
    from transformers import AutoTokenizer

    if fingerprint is None:
        fingerprint = resolve_verifier(tokenizer_path, trust_remote_code=trust_remote_code).fingerprint
    num_layers = len(layers)
    settings = capture_settings(layers, max_seq_len, dtype, regenerate, max_new_tokens, temperature,
                                responses_per_prompt, seed, engine_dtype,  # engine_dtype: the engine's --dtype
                                turns, template_kwargs)
    if plan is not None:
        planned, skipped = read_plan(plan)
    else:
        planned, skipped = plan_rows(tokenizer_path, conversations_file, fingerprint, settings, trust_remote_code)
    hidden_size = get_text_hidden_size(tokenizer_path)
    token_bytes = bytes_per_token(num_layers, hidden_size, dtype)
    rows, left = decide_rows(planned, regenerate, states, budget_bytes, token_bytes)
    to_stream = set(rows["stream_compute"]) | set(rows["stream_plan"]) | set(rows["streamed_known"])
    for key in rows["stream_plan"]:  # prefill: the plan holds the ids; nothing for the engine
        publish_streamed_row(key, [{"input_ids": r["prompt_ids"], "loss_mask": r["loss_mask"]} for r in planned[key]])
    # every first answer before any second one: a later turn waits for the answer before it (turn_prompt)
    todo = sorted((key for key in planned if key in set(rows["keep"] + rows["pending"] + rows["stream_compute"])),
                  key=lambda key: planned[key][0].get("turn", 0))
    keep_if_room = set(rows["pending"])
    gen = {"max_new_tokens": max_new_tokens, "temperature": temperature} if regenerate else None  # seeds: plan_rows
    tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    published = {key: Future() for key in todo}  # a row's answer once it is stored (None: nothing to answer)

    def answer_of(key: str) -> str | None:
        if key in published:
            return published[key].result()
        samples = read_row(key, streamed=not have_row(key))["samples"]
        return samples[0]["response"] if samples else None

    def turn_prompt(req: dict) -> list[int] | None:
        """A later turn's prompt ids (None: an earlier turn has no answer, or no room is left)."""
        context = turn_context(req, answer_of)
        ids = chat_prompt_ids(tok, context, template_kwargs) if context is not None else []
        return ids if context is not None and len(ids) < max_seq_len else None

    t0, tokens, generated, fleet, kept_bytes = time.perf_counter(), 0, 0, None, 0
    if todo:
        if not engines:
            raise RuntimeError(f"{len(todo)} rows need the verifier but no engine was started")
        fleet = Fleet([engines] if isinstance(engines, Engine) else engines)
        for engine in fleet.engines:
            probe(engine, tok, num_layers)
        with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=60),
                          limits=httpx.Limits(max_connections=IN_FLIGHT)) as client, \
                ThreadPoolExecutor(IN_FLIGHT) as pool:
            futures = {(key, j): pool.submit(_sent, fleet, client, req, gen, turn_prompt)
                       for key in todo for j, req in enumerate(planned[key])}
            try:
                for count, key in enumerate(todo, 1):
                    samples, engine_of_row, row_tokens = [], None, 0
                    for j, req in enumerate(planned[key]):
                        answer, saved = _answer_and_states(fleet, futures.pop((key, j)), pool, client, req, gen,
                                                           turn_prompt)
                        if saved is None:  # a later turn past data.max_seq_len: the row holds no sample
                            continue
                        ids, mask, hs = _sample(dict(req, prompt_ids=answer["prompt_ids"]), saved, max_seq_len,
                                                regenerate)
                        samples.append({"input_ids": ids, "loss_mask": mask, "hidden_states": hs,
                                        "response": answer["text"] if regenerate else None})
                        generated += answer["generated"]
                        row_tokens += len(ids)
                        engine_of_row = answer["engine"]
                    if key in keep_if_room and row_estimate(row_tokens, len(samples), token_bytes) <= left:
                        left -= row_estimate(row_tokens, len(samples), token_bytes)
                    elif key in keep_if_room:
                        to_stream.add(key)
                    if key in to_stream:
                        publish_streamed_row(key, samples)
                    else:
                        publish_row(key, samples, dtype)
                        kept_bytes += row_bytes(key)
                    published[key].set_result(samples[0]["response"] if samples else None)
                    tokens += row_tokens
                    fleet.credit(engine_of_row, row_tokens)
                    if progress:
                        progress(count, len(todo), tokens / (time.perf_counter() - t0))
            finally:
                for f in futures.values():  # interrupted: do not send what is still queued
                    f.cancel()
                for f in published.values():  # and let a later turn waiting on an unanswered one end
                    if not f.done():
                        f.set_result(None)
    seconds = time.perf_counter() - t0

    keys = list(planned)
    tag_ids = reasoning_tag_ids(tok, reasoning_tags)
    digests = assemble(out, keys, set(todo), to_stream, None if reasoning_in_loss else tag_ids)
    from datasets import load_from_disk

    ds = load_from_disk(str(out))
    masks = ds["loss_mask"]
    if regenerate:
        write_responses(out / "responses.jsonl", planned, read_conversations(conversations_file), to_stream, turns)
    answer_tokens, reasoning_tokens = answer_split(keys, to_stream, tag_ids)
    streamed_samples = sum(len(read_row(key, streamed=True)["samples"]) for key in to_stream)
    return {
        "samples": len(ds),
        "rows": len(keys),
        "rows_computed": len(todo),
        "rows_reused": len(keys) - len(todo),
        "rows_skipped": skipped,
        "samples_without_loss_tokens": sum(1 for m in masks if not int(m.sum())),
        "tokens": int(sum(ds["seq_len"])),
        "extracted_tokens": tokens,
        "generated_tokens": generated,
        "loss_tokens": int(sum(int(m.sum()) for m in masks)),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds and tokens else 0.0,
        "generated_tokens_per_s": generated / seconds if seconds and generated else 0.0,
        "bytes_per_token": token_bytes,
        "states": states if not budget_bytes else f"keep (budget {budget_bytes / 1e9:g} GB)",
        "bytes_kept": kept_bytes,  # states this pass stored (rows reused from the store not counted)
        "bytes_linked": sum(f.stat().st_size for f in (out / "hidden_states").glob("hs_*.safetensors")),
        "samples_streamed": streamed_samples,
        "rows_streamed": len(to_stream),
        "hidden_size": hidden_size,
        "backend": "vllm",
        "mode": "generate+capture" if regenerate else "prefill",
        "file_sha256": digests,
        "rows_linked": [key for key in keys if key not in to_stream],  # a streamed row's ids are in the view
        "engines": fleet.shares() if fleet else [],
        "longest_sample": int(max(ds["seq_len"], default=0)),
        "samples_at_max_seq_len": sum(1 for n in ds["seq_len"] if n >= max_seq_len),
        "answer_tokens": answer_tokens,  # the verifier's answers' tokens (the whole loss when reasoning is in it)
        "reasoning_tokens": reasoning_tokens,  # of those, in reasoning blocks (data.reasoning_tags); None: no tags
        "reasoning_in_loss": reasoning_in_loss,
        "turns": turns,
    }


def turn_context(req: dict, answer_of) -> list[dict] | None:
    """A later turn's context: the data's messages before it with the verifier's answers (answer_of(row key)) in
    place of the data's assistant turns; None when one of those turns has no answer."""
    context = list(req["context"])
    for pos, key in zip(req["answered"], req["answer_keys"]):
        text = answer_of(key)
        if text is None:
            return None
        context[pos] = {"role": "assistant", "content": text}
    return context


def write_responses(path: Path, planned: dict[str, list[dict]], rows: list[list[dict]], streamed: set[str],
                    turns: str = "last") -> None:
    """responses.jsonl: each stored answer as a conversation, its context as the verifier saw it (the earlier
    turns' answers in place of the data's under data.regenerate_turns=all)."""
    answers: dict[str, str | None] = {}
    with path.open("w") as f:
        for key, reqs in planned.items():
            samples = read_row(key, streamed=key in streamed)["samples"]
            answers[key] = samples[0]["response"] if samples else None
            for req, s in zip(reqs, samples):
                if "turn" in req:
                    context = turn_context(req, answers.get)
                else:
                    msgs = rows[req["row"]]
                    context = msgs[: answer_positions(msgs)[0]] if turns == "all" else prompt_part(msgs)
                msgs = chat_messages(context) + [{"role": "assistant", "content": s["response"]}]
                tools = {"tools": tools_of(context)} if tools_of(context) else {}
                f.write(json.dumps({"messages": msgs, **tools}, ensure_ascii=False) + "\n")


def answer_split(keys: list[str], streamed: set[str], tag_ids: tuple[int, int] | None) -> tuple[int, int | None]:
    """(answer tokens, of them reasoning tokens) over the rows' samples: the loss mask as captured marks the
    answer; reasoning is told by its tags (None when the verifier's vocabulary has no such tokens)."""
    answer, reasoning = 0, 0
    for key in keys:
        for j, meta in enumerate(read_row(key, streamed=key in streamed)["samples"]):
            mask = meta["loss_mask"]
            if 1 not in mask:
                continue
            answer += sum(mask)
            if tag_ids is not None:
                ids = meta["input_ids"] if key in streamed else _row_ids(key, j)
                start = mask.index(1)
                reasoning += sum(f and m for f, m in zip(reasoning_flags(ids, start, tag_ids), mask[start:]))
    return answer, reasoning if tag_ids is not None else None


def _row_ids(key: str, j: int) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(row_path(key) / f"hs_{j}.safetensors"), "pt") as f:
        return f.get_tensor("token_ids").tolist()


def plan_for_run(verifier, data_dir: str, cfg, plan_file: Path) -> tuple[int, int]:
    """Tokenize a run's training rows once into the plan generate_and_capture sends: (rows, rows to compute)."""
    e = cfg.extraction
    settings = run_capture_settings(verifier, cfg)
    planned, skipped = plan_rows(verifier.path, Path(data_dir) / "train.jsonl", verifier.fingerprint, settings,
                                 verifier.trust_remote_code)
    check_held_out_rendering(verifier, data_dir, cfg)
    token_bytes = bytes_per_token(len(settings["layers"]), get_text_hidden_size(verifier.path), e.dtype)
    budget = budget_bytes(cfg)
    if budget is not None:
        check_budget(planned, budget, token_bytes)  # before any load
    write_plan(plan_file, planned, skipped)
    rows, _ = decide_rows(planned, cfg.data.regenerate, e.states, budget, token_bytes)
    return len(planned), len(rows["keep"]) + len(rows["pending"]) + len(rows["stream_compute"])


def check_held_out_rendering(verifier, data_dir: str, cfg) -> None:
    """Before any load: the held-out rows (the smoke test's prompts) render with the run's template settings
    (eaglet.data.check_template_settings; plan_rows checks the training rows)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier.path, trust_remote_code=verifier.trust_remote_code)
    d, held = cfg.data, Path(data_dir) / "eval.jsonl"
    check_template_settings(tok, {held: read_conversations(held)}, d.chat_template_kwargs, d.reasoning_tags,
                            d.reasoning_in_loss)


def budget_bytes(cfg) -> int | None:
    gb = cfg.extraction.disk_budget_gb
    return None if gb is None else int(gb * 1e9)


def capture_for_run(engines: list[Engine] | None, verifier, data_dir: str, out: Path, cfg, progress,
                    plan: str | None) -> dict:
    """generate_and_capture with a run's settings (plan: plan_for_run's file, if the run made one)."""
    d = cfg.data
    return generate_and_capture(
        engines, verifier.path, Path(data_dir) / "train.jsonl", out,
        capture_layers(verifier.aux_layer_ids, verifier.num_layers), d.max_seq_len, cfg.extraction.dtype,
        d.regenerate, d.max_new_tokens, d.temperature, d.responses_per_prompt, d.seed, verifier.trust_remote_code,
        progress, fingerprint=verifier.fingerprint, engine_dtype=capture_engine_dtype(cfg),
        plan=Path(plan) if plan else None, states=cfg.extraction.states, budget_bytes=budget_bytes(cfg),
        turns=d.regenerate_turns, template_kwargs=d.chat_template_kwargs, reasoning_tags=d.reasoning_tags,
        reasoning_in_loss=d.reasoning_in_loss)


def view_for_run(engines: list[Engine] | None, verifier, data_dir: str, out: Path, cfg, progress, plan: str | None,
                 content_key: str) -> dict:
    """capture_for_run, then the view's record of the key of the view that would keep all its rows' states, when
    some are streamed (content_key: keys.capture_content_key)."""
    stats = capture_for_run(engines, verifier, data_dir, out, cfg, progress, plan)
    if stats["rows_streamed"]:
        set_view_content(out, content_key)
    return stats


def baseline_from_engine(out: Path, engines: list[Engine], verifier, data_dir: str, cfg) -> dict:
    """The smoke baseline (eaglet.evaluate.smoke.write_baseline) from a capture engine's greedy answers to the held-out
    prompts (the first that still answers): the smoke test then starts one engine, the one with the draft."""
    engine = next((e for e in engines if healthy(e.endpoint)), None)
    if engine is None:
        raise EngineError("no capture engine answers any more for the smoke baseline")

    answers = greedy_answers(engine, verifier.path, held_out_prompts(data_dir, cfg), cfg.smoke.max_tokens,
                             verifier.trust_remote_code, cfg.data.chat_template_kwargs)
    return write_baseline(out, answers, engine="capture")


def greedy_answers(engine: Engine, tokenizer_path: str, prompts: list[list[dict]], max_tokens: int,
                   trust_remote_code: bool = False, template_kwargs: dict | None = None) -> dict:
    """The verifier's greedy answers to `prompts` from the capture engine while it is up: the token ids and the
    batch's speed, in the form of an offline vLLM job's result (eaglet.evaluate.smoke's baseline). The engine captures
    these prompts' states too (its method cannot be turned off per request); they are read and dropped.
    Greedy ids are the verifier's whichever engine computes them (tests/test_flow_e2e.py: the same ids as an
    offline engine's), so the smoke test's baseline needs no engine of its own when the data pass had one."""
    import httpx
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    requests = [chat_prompt_ids(tok, conv, template_kwargs) for conv in prompts]

    def answer(client, ids: list[int]) -> list[int]:
        body = {"model": engine.served_name, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, "kv_transfer_params": {}}
        r = _post(client, f"{engine.endpoint}/v1/completions", body)
        if r.status_code != 200:
            raise EngineError(f"the verifier engine answered {r.status_code}: {r.text[:500]}")
        out = r.json()
        path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
        if path:
            _load(path)  # waits for the connector's write, then deletes the file
        return list(out["choices"][0]["token_ids"])

    t0 = time.perf_counter()
    with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=60),
                      limits=httpx.Limits(max_connections=IN_FLIGHT)) as client, \
            ThreadPoolExecutor(min(IN_FLIGHT, len(requests))) as pool:
        token_ids = [[ids] for ids in pool.map(lambda ids: answer(client, ids), requests)]
    seconds = time.perf_counter() - t0
    n_tokens = sum(len(ids[0]) for ids in token_ids)
    return {"token_ids": token_ids, "seconds": seconds, "output_tokens": n_tokens,
            "tokens_per_s": n_tokens / seconds if seconds else 0.0, "load_seconds": 0.0}


def summary(stats: dict) -> str:
    """The data pass in a log line: rows computed and reused, samples, and the engine's speed when it ran."""
    line = (f"{stats['rows']} rows: {stats['rows_computed']} computed, {stats['rows_reused']} reused from earlier "
            f"runs; {stats['samples']} samples")
    if stats["rows_computed"]:
        line += (f"; {stats['generated_tokens']} tokens generated, captured {stats['extracted_tokens']} tokens at "
                 f"{stats['tokens_per_s']:.0f} tokens/s")
    if len(stats.get("engines", [])) > 1:
        line += "; per engine: " + describe_shares(stats["engines"])
    return line
