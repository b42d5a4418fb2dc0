"""The vllm capture backend: one pass through a capture engine (eaglet.capture.engine) makes the training data.

With regeneration, each request is a prompt (the verifier's chat template applied here, so the token ids are the
ones the engine sees) answered by the verifier, with `include_output_tokens`: the engine saves the hidden states
of prompt + response (all tokens but the last generated one, which was never an input). The sample is those
token ids, with the loss on the response; its states are the ones computed while generating (they equal a
prefill of the same ids to bf16 rounding: tests/test_capture_vllm.py). Without regeneration each request is a
whole conversation, prefill-only (one generated token, discarded), with the assistant-only loss mask.

Samples are numbered before the pass (row order, responses_per_prompt per row), grouped into shards of
`batch_size` and written by eaglet.capture.shards as each shard's requests finish; the requests of many shards
are in flight at once so the engine's batches stay full. A rerun keeps finished shards: responses and states
are recorded together.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglet.capture.engine import Engine, EngineError
from eaglet.capture.shards import bytes_per_token, finish, get_text_hidden_size, read_records, shards_left, write_shard
from eaglet.data import assistant_mask, prompt_part, read_conversations
from eaglet.errors import EagletError

log = logging.getLogger("eaglet.capture")

IN_FLIGHT = 256  # requests in flight: vLLM batches them (its default max_num_seqs); the rest wait here
# A request waits in vLLM's queue behind at most IN_FLIGHT others; one silent for this long means a stuck engine.
REQUEST_TIMEOUT = 1800.0


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def plan_requests(tokenizer, rows: list[list[dict]], regenerate: bool, max_seq_len: int,
                  responses_per_prompt: int = 1) -> tuple[list[dict], int]:
    """One request per sample, numbered in row order: prompt ids, and for prefill the loss mask. Rows that
    cannot give a trainable token are left out here, before any work (counted)."""
    requests, skipped = [], 0
    for row, msgs in enumerate(rows):
        if regenerate:
            ids = chat_prompt_ids(tokenizer, prompt_part(msgs))
            if len(ids) >= max_seq_len:  # no room for a response token
                skipped += 1
                continue
            requests += [{"row": row, "prompt_ids": ids, "response": j} for j in range(responses_per_prompt)]
        else:
            ids, mask = assistant_mask(tokenizer, msgs, max_seq_len)
            if sum(mask) == 0:
                skipped += 1
                continue
            requests.append({"row": row, "prompt_ids": ids, "loss_mask": mask})
    if not requests:
        raise EagletError("no row keeps a trainable token within data.max_seq_len; raise data.max_seq_len")
    return requests, skipped


def _complete(client, engine: Engine, req: dict, gen: dict | None) -> dict:
    """One request; returns the response text, the captured file's path and the generated token count."""
    body = {"model": engine.served_name, "prompt": req["prompt_ids"], "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {}}
    if gen:
        body.update(max_tokens=gen["max_new_tokens"], temperature=gen["temperature"],
                    seed=gen["seed"] + req["response"], kv_transfer_params={"include_output_tokens": True})
    r = client.post(f"{engine.endpoint}/v1/completions", json=body)
    if r.status_code != 200:
        raise EngineError(f"the verifier engine answered {r.status_code}: {r.text[:500]}")
    out = r.json()
    path = (out.get("kv_transfer_params") or {}).get("hidden_states_path")
    if not path:
        raise EagletError(f"the engine at {engine.endpoint} returned no hidden states: it was not started with the "
                          "extract_hidden_states method and the hidden-states connector (`eaglet verifier serve`)")
    return {"text": out["choices"][0]["text"], "path": path,
            "generated": out.get("usage", {}).get("completion_tokens", 0)}


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
    ids = saved["token_ids"].tolist()
    if ids[: len(req["prompt_ids"])] != req["prompt_ids"]:
        raise EngineError(f"the engine's token ids for sample {req['sample']} do not start with its prompt")
    ids, states = ids[:max_seq_len], saved["hidden_states"][:max_seq_len]
    n_prompt = len(req["prompt_ids"])
    mask = [0] * n_prompt + [1] * (len(ids) - n_prompt) if regenerate else req["loss_mask"][: len(ids)]
    return ids, mask, states


def generate_and_capture(engine: Engine, tokenizer_path: str, conversations_file: Path, out: Path, num_layers: int,
                         max_seq_len: int, batch_size: int, dtype: str = "bfloat16", regenerate: bool = True,
                         max_new_tokens: int = 128, temperature: float = 0.0, responses_per_prompt: int = 1,
                         seed: int = 0, trust_remote_code: bool = False, progress=None) -> dict:
    """Fill `out` (eaglet.capture.shards layout, plus responses.jsonl with the verifier's answers) from one pass
    through `engine`. progress(shards done, shards, tokens/s)."""
    import httpx
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    rows = read_conversations(conversations_file)
    requests, skipped = plan_requests(tok, rows, regenerate, max_seq_len, responses_per_prompt)
    for i, req in enumerate(requests):
        req["sample"] = i
    shards = [list(range(b, min(b + batch_size, len(requests)))) for b in range(0, len(requests), batch_size)]
    hs_dir = out / "hidden_states"
    todo = shards_left(hs_dir, shards)
    resumed = len(shards) - len(todo)
    gen = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed} if regenerate else None

    t0, tokens, generated = time.perf_counter(), 0, 0
    if todo:
        probe(engine, tok, num_layers)
        with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT, connect=60),
                          limits=httpx.Limits(max_connections=IN_FLIGHT)) as client, \
                ThreadPoolExecutor(IN_FLIGHT) as pool:
            futures = {i: pool.submit(_complete, client, engine, requests[i], gen) for n in todo for i in shards[n]}
            try:
                for count, n in enumerate(todo, 1):
                    batch, masks, states, texts = [], [], [], []
                    for i in shards[n]:
                        answer = futures.pop(i).result()
                        ids, mask, hs = _sample(requests[i], _load(answer["path"]), max_seq_len, regenerate)
                        batch.append(ids), masks.append(mask), states.append(hs), texts.append(answer["text"])
                        generated += answer["generated"]
                    meta = {"loss_masks": masks, "rows": [requests[i]["row"] for i in shards[n]]}
                    if regenerate:
                        meta["responses"] = texts
                    tokens += write_shard(hs_dir, n, shards[n], batch, states, dtype, meta)
                    if progress:
                        progress(resumed + count, len(shards), tokens / (time.perf_counter() - t0))
            finally:
                for f in futures.values():  # interrupted: do not send what is still queued
                    f.cancel()
    seconds = time.perf_counter() - t0

    samples, freq, answers = [], Counter(), []
    for rec in read_records(hs_dir):
        for i, mask, row, text in zip(rec["samples"], rec["loss_masks"], rec["rows"],
                                      rec.get("responses") or [None] * len(rec["samples"])):
            ids = _token_ids(hs_dir, i)
            samples.append((i, {"input_ids": ids, "loss_mask": mask, "seq_len": len(ids)}))
            freq.update(t for t, m in zip(ids, mask) if m)
            if text is not None:
                answers.append((i, prompt_part(rows[row]) + [{"role": "assistant", "content": text}]))
    samples = [s for _, s in sorted(samples, key=lambda x: x[0])]
    if regenerate:
        with (out / "responses.jsonl").open("w") as f:
            for _, msgs in sorted(answers, key=lambda x: x[0]):
                f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
    hidden_size = get_text_hidden_size(tokenizer_path)
    return {
        "samples": len(samples),
        "rows_skipped": skipped,
        "samples_without_loss_tokens": sum(1 for s in samples if not any(s["loss_mask"])),
        "tokens": sum(s["seq_len"] for s in samples),
        "extracted_tokens": tokens,
        "generated_tokens": generated,
        "shards": len(shards),
        "resumed_shards": resumed,
        "loss_tokens": sum(freq.values()),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds and tokens else 0.0,
        "generated_tokens_per_s": generated / seconds if seconds and generated else 0.0,
        "bytes_per_token": bytes_per_token(num_layers, hidden_size, dtype),
        "hidden_size": hidden_size,
        "backend": "vllm",
        "mode": "generate+capture" if regenerate else "prefill",
        "file_sha256": finish(out, samples, freq),
    }


def _token_ids(hs_dir: Path, i: int) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(hs_dir / f"hs_{i}.safetensors"), "pt") as f:
        return f.get_tensor("token_ids").tolist()
