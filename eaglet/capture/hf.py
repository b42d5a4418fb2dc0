"""The hf capture backend: hidden states of given conversations from transformers forward passes, in this
process or spread over Dask workers (eaglet.capture.dask). For verifiers vLLM cannot load, and for fan-out over
many hosts; with data.regenerate the responses come first from a separate vLLM generation (eaglet.capture.regenerate),
so this backend loads the verifier twice where the vllm backend loads it once.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from eaglet.capture.hf_forward import extract_batch, load_hf_model, release_memory, resolve_device
from eaglet.capture.shards import bytes_per_token, finish, get_text_hidden_size, shards_left, write_shard
from eaglet.data import read_conversations, tokenize_conversations
from eaglet.capture.dask import extract_shards


def extract_hidden_states(
    verifier_path: str,
    conversations_file: Path,
    out: Path,
    aux_ids: list[int],
    max_seq_len: int,
    batch_size: int,
    dtype: str = "bfloat16",
    device: str = "auto",
    trust_remote_code: bool = False,
    progress=None,
    workers: int = 1,
    scheduler: str | None = None,
) -> dict:
    """Tokenize the conversations, run the verifier, and write everything speculators' trainer reads
    (eaglet.capture.shards). A shard is one batch (the same batches every time: longest first); the verifier is
    loaded only if a shard is left to do. workers > 1 or a Dask scheduler address: the shards left are spread
    over a Dask cluster, each worker loading the verifier once; the files are the same."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier_path, trust_remote_code=trust_remote_code)
    rows = read_conversations(conversations_file)
    samples, freq = tokenize_conversations(tok, rows, max_seq_len)
    hs_dir = out / "hidden_states"
    order = sorted(range(len(samples)), key=lambda i: -samples[i]["seq_len"])  # less padding per batch
    shards = [order[b : b + batch_size] for b in range(0, len(order), batch_size)]
    todo = shards_left(hs_dir, shards)
    resumed = len(shards) - len(todo)

    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    done_tokens, t0 = 0, time.perf_counter()
    worker_loads = None
    if todo and (workers > 1 or scheduler):
        spec = {"verifier": verifier_path, "device": device, "trust_remote_code": trust_remote_code,
                "aux_ids": aux_ids, "pad_id": pad_id, "hs_dir": str(hs_dir), "dtype": dtype}
        result = extract_shards(spec, [(n, shards[n]) for n in todo], samples, workers, scheduler, progress=(
            (lambda done, tokens: progress(resumed + done, len(shards),
                                           tokens / (time.perf_counter() - t0))) if progress else None))
        done_tokens, worker_loads = result["extracted_tokens"], result["worker_verifier_loads"]
        todo = []
    model, load_seconds = None, 0.0
    for count, n in enumerate(todo, 1):
        if model is None:
            model = load_hf_model(verifier_path, resolve_device(device), trust_remote_code)
            load_seconds = time.perf_counter() - t0
            t0 = time.perf_counter()  # tokens/s measures extraction, not the load
        idx = shards[n]
        batch = [samples[i]["input_ids"] for i in idx]
        try:
            states = extract_batch(model, batch, aux_ids, pad_id)
        except torch.OutOfMemoryError:
            del model  # retries run in this process: give the memory back before the caller retries
            release_memory()
            raise
        done_tokens += write_shard(hs_dir, n, idx, batch, states, dtype)
        if progress:
            progress(resumed + count, len(shards), done_tokens / (time.perf_counter() - t0))
    seconds = time.perf_counter() - t0
    del model

    hidden_size = get_text_hidden_size(verifier_path)
    stats = {
        "samples": len(samples),
        "tokens": sum(s["seq_len"] for s in samples),
        "extracted_tokens": done_tokens,
        "shards": len(shards),
        "resumed_shards": resumed,
        "loss_tokens": sum(freq.values()),
        "load_seconds": load_seconds,
        "seconds": seconds,
        "tokens_per_s": done_tokens / seconds if seconds and done_tokens else 0.0,
        "bytes_per_token": bytes_per_token(len(aux_ids) + 1, hidden_size, dtype),
        "hidden_size": hidden_size,
        "backend": "hf",
        "file_sha256": finish(out, samples, freq),  # hashed once, as each file was written
    }
    if worker_loads is not None:
        stats["worker_verifier_loads"] = worker_loads
    return stats


def extract_for_run(verifier, conversations_dir: str, out: Path, cfg, batch_size: int, progress=None) -> dict:
    """extract_hidden_states with a run's settings (batch_size: the task's, halved after running out of memory)."""
    e = cfg.extraction
    return extract_hidden_states(verifier.path, Path(conversations_dir) / "train.jsonl", out, verifier.aux_layer_ids,
                                 cfg.data.max_seq_len, batch_size, e.dtype, e.device, verifier.trust_remote_code,
                                 progress, workers=e.workers, scheduler=e.scheduler_address)


def summary(stats: dict) -> str:
    """The extraction in a log line."""
    return (f"extracted {stats['extracted_tokens']} tokens at {stats['tokens_per_s']:.0f} tokens/s "
            f"({stats['resumed_shards']} of {stats['shards']} shards resumed)")
