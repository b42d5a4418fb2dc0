"""Hidden-state extraction with vLLM (extraction.backend=vllm), for verifiers that need several GPUs.

vLLM's `extract_hidden_states` speculative method keeps the requested layers' hidden states in its cache, and
the hidden-states connector writes them per request to a safetensors file ([T, n_layers, H] + token_ids) when the
one-token generation finishes. vLLM's layer ids are the hf extractor's: id k is the input of decoder layer k
(0 = embeddings) and id L (the layer count) the last layer's output before the final norm. So asking for the aux
ids plus L gives exactly the hf backend's [T, n_aux+1, H]; each file is then written by the same
`eaglet.extract.write_shard` (dtype, fp8 scales, shard records, resume), so the artifact has the hf layout.

The engine runs in a child process (`python -m eaglet.vllm_worker`, job mode "extract"), reading the token ids
from the dataset the parent already saved. On CPU, vLLM's CPU backend runs with eaglet.vllm_cpu_connector (the
upstream connector stages its copies through CUDA).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

log = logging.getLogger("eaglet.extract")

SEQUENCES_PER_CALL = 256  # per llm.generate: enough to keep vLLM's batches full, small enough to report progress
SCRATCH = ".vllm"  # under hidden_states/: the connector's files, each deleted once re-written as a shard file


def extract_shards_vllm(verifier: str, dataset_dir: Path, hs_dir: Path, shards: list[tuple[int, list[int]]],
                        aux_ids: list[int], dtype: str, max_model_len: int, tensor_parallel_size: int = 1,
                        device: str = "auto", trust_remote_code: bool = False, progress=None) -> dict:
    """Extract `shards` ((shard number, sample indices) pairs) in one vLLM engine. progress(shards done,
    tokens/s). Returns extracted tokens and the seconds spent after the engine was up."""
    from eaglet.verifier import read_config_dict, text_config_of
    from eaglet.vllm_run import run_vllm_job

    num_layers = text_config_of(read_config_dict(Path(verifier)))["num_hidden_layers"]
    job = {
        "mode": "extract",
        "verifier": verifier,
        "trust_remote_code": trust_remote_code,
        "layers": sorted(aux_ids) + [num_layers],
        "tensor_parallel_size": tensor_parallel_size,
        "max_model_len": max_model_len,
        "dataset": str(dataset_dir),
        "hs_dir": str(hs_dir),
        "shards": shards,
        "dtype": dtype,
    }
    env = {"CUDA_VISIBLE_DEVICES": device.split(":", 1)[1]} if device.startswith("cuda:") else None
    log.info(f"vLLM extraction: {len(shards)} shards, layers {job['layers']}, tensor parallel {tensor_parallel_size}")
    try:
        return run_vllm_job(job, progress=(lambda done, _total, tps: progress(done, tps)) if progress else None,
                            env=env)
    finally:
        shutil.rmtree(hs_dir / SCRATCH, ignore_errors=True)  # also after a crash: never part of the artifact


def engine_kwargs(job: dict, storage: Path) -> dict:
    from vllm.platforms import current_platform

    connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    if current_platform.is_cpu():
        connector = {"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": "eaglet.vllm_cpu_connector"}
    return dict(
        model=job["verifier"],
        trust_remote_code=job.get("trust_remote_code", False),
        dtype="bfloat16",  # as the hf backend loads the verifier
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
        max_model_len=job["max_model_len"],
        max_num_batched_tokens=max(job["max_model_len"], 8192),
        seed=0,
        enforce_eager=True,  # prefill only: CUDA graphs speed up decoding, which extraction does not do
        enable_chunked_prefill=False,  # required by extract_hidden_states: a request's states in one step
        enable_prefix_caching=False,  # every sequence computed from its own tokens, whatever ran before it
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": job["layers"]}},
        },
        kv_transfer_config={**connector, "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(storage)}},
    )


def run_extract_job(job: dict, report) -> dict:
    """In the vLLM child process: generate one token per sequence, re-write the connector's files as shards.
    report(done, total, tokens, tokens_per_s) is called after each group of shards."""
    from collections import deque

    from datasets import load_from_disk
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states,
        load_hidden_states,
    )
    from vllm.inputs import TokensPrompt

    from eaglet.extract import write_shard

    hs_dir = Path(job["hs_dir"])
    storage = hs_dir / SCRATCH
    storage.mkdir(parents=True, exist_ok=True)
    dataset = load_from_disk(job["dataset"]).with_format(None)
    llm = LLM(**engine_kwargs(job, storage))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0, tokens, done = time.perf_counter(), 0, 0
    shards = deque((n, idx) for n, idx in job["shards"])
    while shards:
        group, count = [], 0
        while shards and (not group or count + len(shards[0][1]) <= SEQUENCES_PER_CALL):
            group.append(shards.popleft())
            count += len(group[-1][1])
        batches = [[dataset[i]["input_ids"] for i in idx] for _, idx in group]
        outputs = iter(llm.generate([TokensPrompt(prompt_token_ids=ids) for batch in batches for ids in batch],
                                    params, use_tqdm=False))  # in the order given
        for (n, idx), batch in zip(group, batches):
            states = []
            for ids in batch:
                path = next(outputs).kv_transfer_params["hidden_states_path"]
                saved = load_hidden_states(path)  # waits for the connector's write
                cleanup_hidden_states(path)
                if saved["token_ids"].tolist() != ids or saved["hidden_states"].shape[1] != len(job["layers"]):
                    raise RuntimeError(f"vLLM's hidden states for a sequence of {len(ids)} tokens do not match it: "
                                       f"tokens {saved['token_ids'].shape[0]}, states {tuple(saved['hidden_states'].shape)}")
                states.append(saved["hidden_states"])  # the engine's dtype, bfloat16 like hf's
            tokens += write_shard(hs_dir, n, idx, batch, states, job["dtype"])
        done += len(group)
        seconds = time.perf_counter() - t0
        report(done, len(job["shards"]), tokens, tokens / seconds)
    return {"extracted_tokens": tokens, "seconds": time.perf_counter() - t0}
