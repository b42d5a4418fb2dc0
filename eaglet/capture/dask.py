"""Extraction shards spread over a Dask cluster (dask.distributed), for datasets one machine cannot get through.

Dask does the distributing: scheduling, worker processes, re-running the shards of a worker that died. eaglet
only says what a shard is. Each worker process loads the verifier once (a per-process memo) and takes whole
shards; a shard is written exactly as the in-process extractor writes it (`eaglet.capture.shards.write_shard`), so
the artifact does not depend on how many workers made it. Workers must see the verifier path and the output
directory (a shared filesystem across machines).

  workers=N           a LocalCluster of N worker processes on this machine (one thread each)
  scheduler=ADDRESS   an existing cluster, e.g. tcp://10.0.0.5:8786 (`dask scheduler` + `dask worker` per host)
"""

from __future__ import annotations

from pathlib import Path
from eaglet.capture.hf_forward import load_hf_model
from eaglet.capture.hf_forward import extract_batch, resolve_device
from eaglet.capture.shards import write_shard
from eaglet.capture import hf_forward

_MODELS: dict[tuple, object] = {}  # per worker process: (path, device) -> the loaded verifier


def _verifier(path: str, device: str, trust_remote_code: bool):
    key = (path, device)
    if key not in _MODELS:
        _MODELS[key] = load_hf_model(path, device, trust_remote_code)
    return _MODELS[key]


def _run_shard(spec: dict, n: int, idx: list[int], batch: list[list[int]]) -> int:
    model = _verifier(spec["verifier"], resolve_device(spec["device"]), spec["trust_remote_code"])
    states = extract_batch(model, batch, spec["aux_ids"], spec["pad_id"])
    return write_shard(Path(spec["hs_dir"]), n, idx, batch, states, spec["dtype"])


def _verifier_loads() -> int:
    return hf_forward.VERIFIER_LOADS


def extract_shards(spec: dict, shards: list[tuple[int, list[int]]], samples: list[dict], workers: int,
                   scheduler: str | None = None, progress=None) -> dict:
    """Run `shards` ((shard number, sample indices) pairs) on the cluster; returns extracted tokens and each
    worker's verifier loads."""
    from dask.distributed import Client, LocalCluster, as_completed

    cluster = None
    if scheduler:
        client = Client(scheduler)
    else:
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
    try:
        futures = [client.submit(_run_shard, spec, n, idx, [samples[i]["input_ids"] for i in idx], pure=False)
                   for n, idx in shards]
        tokens = 0
        for done, future in enumerate(as_completed(futures), 1):
            tokens += future.result()
            if progress:
                progress(done, tokens)
        loads = client.run(_verifier_loads)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    return {"extracted_tokens": tokens, "worker_verifier_loads": loads}
