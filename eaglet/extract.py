"""Hidden-state extraction in speculators' on-disk format: Hugging Face transformers here (backend hf, one
device or Dask workers), or vLLM's extract_hidden_states method (backend vllm, eaglet.extract_vllm).

Output directory (speculators `--data-path`):
  data-*.arrow, state.json ...   HF `save_to_disk` dataset with input_ids, loss_mask, seq_len
  hidden_states/hs_{i}.safetensors   hidden_states [T, n_aux+1, H] (aux layers ascending, then the last
                                     layer, all pre-final-norm) and token_ids [T]
  token_freq.pt                  {token_id: count} over loss-masked tokens

Layer convention (vLLM's): aux id k = HF `hidden_states[k]` (0 = embeddings, k = output of decoder layer k-1).
HF's last entry is post-final-norm, vLLM's is not, so the last layer is captured at the input of the final norm.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from eaglet.data import read_conversations, tokenize_conversations
from eaglet.errors import EagletError
from eaglet.store import file_sha256

# Part of the extraction cache key: the two backends agree to bf16 rounding, not bit for bit.
EXTRACTOR_VERSIONS = {"hf": "hf-1", "vllm": "vllm-1"}

# How many times this process loaded verifier weights. An in-process count for tests; the run report derives
# verifier_loads from which artifacts the run built (store.built_by_this_process_since).
VERIFIER_LOADS = 0


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_backend(backend: str = "auto", device: str = "auto", tensor_parallel_size: int = 1, workers: int = 1,
                    scheduler: str | None = None) -> str:
    """The backend an extraction will use ('auto' resolved), or one sentence saying which setting to change.
    Checked before any weights load."""
    from eaglet.train import visible_accelerators

    gpus = visible_accelerators()
    if device.startswith("cuda") and not gpus:
        raise EagletError(f"extraction.device={device} but no CUDA device is visible; use 'auto' or 'cpu'")
    spread = workers > 1 or bool(scheduler)
    if backend == "auto":
        backend = "vllm" if gpus and device != "cpu" and not spread else "hf"
    if backend == "hf":
        if tensor_parallel_size > 1:
            raise EagletError(f"extraction.tensor_parallel_size={tensor_parallel_size} applies to the vllm backend; "
                              "set extraction.backend=vllm, or tensor_parallel_size=1 for hf")
        return backend
    if spread:
        raise EagletError("extraction.workers and scheduler_address spread the hf backend over Dask; with "
                          "extraction.backend=vllm one engine spans extraction.tensor_parallel_size GPUs: set "
                          "workers=1 and no scheduler, or backend=hf")
    if device == "cpu" and gpus:
        raise EagletError("extraction.backend=vllm runs on this machine's GPUs; use backend=hf to extract on CPU")
    if tensor_parallel_size > max(gpus, 1):
        raise EagletError(f"extraction.tensor_parallel_size={tensor_parallel_size} needs that many GPUs; "
                          f"{gpus} visible")
    if device.startswith("cuda:") and tensor_parallel_size > 1:
        raise EagletError(f"extraction.device={device} pins one GPU but tensor_parallel_size="
                          f"{tensor_parallel_size}; use device=auto (CUDA_VISIBLE_DEVICES picks the GPUs)")
    return backend


def load_verifier(path: str, device: str, trust_remote_code: bool = False):
    global VERIFIER_LOADS
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    # Kimi-K2.5 and VL verifiers are image-text-to-text models around the language model we read.
    auto = AutoModelForCausalLM
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and hasattr(config, "text_config"):
        auto = AutoModelForImageTextToText
    model = auto.from_pretrained(path, dtype=torch.bfloat16, trust_remote_code=trust_remote_code)
    VERIFIER_LOADS += 1
    return model.to(device).eval()


def final_norm(model) -> torch.nn.Module:
    decoder = model.get_decoder()
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise RuntimeError(f"{type(model).__name__} has no final norm at get_decoder().norm")
    return norm


def pad_batch(batch_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and the attention mask that hides the padding."""
    longest = max(len(x) for x in batch_ids)
    ids = torch.full((len(batch_ids), longest), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, x in enumerate(batch_ids):
        ids[i, : len(x)] = torch.tensor(x)
        attn[i, : len(x)] = 1
    return ids, attn


@torch.inference_mode()
def extract_batch(model, batch_ids: list[list[int]], aux_ids: list[int], pad_id: int) -> list[torch.Tensor]:
    """[T_i, n_aux+1, H] per sequence: aux layers in ascending order, then the pre-norm last layer."""
    device = next(model.parameters()).device
    ids, attn = pad_batch(batch_ids, pad_id)
    captured = {}
    hook = final_norm(model).register_forward_pre_hook(lambda _m, args: captured.__setitem__("last", args[0]))
    try:
        out = model.model(input_ids=ids.to(device), attention_mask=attn.to(device), output_hidden_states=True) \
            if hasattr(model, "model") else model(input_ids=ids.to(device), attention_mask=attn.to(device),
                                                  output_hidden_states=True)
    finally:
        hook.remove()
    layers = [out.hidden_states[k] for k in sorted(aux_ids)] + [captured["last"]]
    stacked = torch.stack(layers, dim=2)  # [B, T, n_aux+1, H]
    return [stacked[i, : len(x)].cpu() for i, x in enumerate(batch_ids)]


SHARD_RECORDS = ".shards"  # hidden_states/.shards/<n>.json: a finished shard's samples and file digests


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
    backend: str = "hf",
    tensor_parallel_size: int = 1,
) -> dict:
    """Tokenize the conversations, run the verifier, and write everything speculators' trainer reads.

    Resumable: a shard is one batch (the same batches every time: longest first). Each shard's files are
    written under temporary names and renamed, then a record with their sha256 is written. A rerun into the
    same `out` keeps the shards whose records and files agree and recomputes the rest, so a kill -9 costs at
    most the shard in flight and the result is byte-identical to an uninterrupted run. The verifier is loaded
    only if a shard is left to do.

    workers > 1 or a Dask scheduler address: the shards left are spread over a Dask cluster (eaglet.distributed),
    each worker loading the verifier once; the files are the same.
    backend "vllm": one vLLM engine (tensor_parallel_size GPUs) computes the states (eaglet.extract_vllm); the
    shards, records and files are written the same way.
    """
    backend = resolve_backend(backend, device, tensor_parallel_size, workers, scheduler)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier_path, trust_remote_code=trust_remote_code)
    rows = read_conversations(conversations_file)
    samples, freq = tokenize_conversations(tok, rows, max_seq_len)
    hs_dir = out / "hidden_states"
    records = hs_dir / SHARD_RECORDS
    records.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(samples)), key=lambda i: -samples[i]["seq_len"])  # less padding per batch
    shards = [order[b : b + batch_size] for b in range(0, len(order), batch_size)]
    todo = [n for n, idx in enumerate(shards) if not _shard_done(records / f"{n}.json", idx, hs_dir)]
    resumed = len(shards) - len(todo)

    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    _save_dataset(samples, out)  # first: the vllm backend's engine process reads the token ids from it
    done_tokens, t0 = 0, time.perf_counter()
    worker_loads = None
    if todo and backend == "vllm":
        from eaglet.extract_vllm import extract_shards_vllm

        result = extract_shards_vllm(
            verifier_path, out, hs_dir, [(n, shards[n]) for n in todo], aux_ids, dtype,
            max_model_len=max(samples[i]["seq_len"] for n in todo for i in shards[n]) + 1,
            tensor_parallel_size=tensor_parallel_size, device=device, trust_remote_code=trust_remote_code,
            progress=(lambda done, tps: progress(resumed + done, len(shards), tps)) if progress else None)
        done_tokens, t0 = result["extracted_tokens"], time.perf_counter() - result["seconds"]
        todo = []
    elif todo and (workers > 1 or scheduler):
        from eaglet.distributed import extract_shards

        spec = {"verifier": verifier_path, "device": device, "trust_remote_code": trust_remote_code,
                "aux_ids": aux_ids, "pad_id": pad_id, "hs_dir": str(hs_dir), "dtype": dtype}
        result = extract_shards(spec, [(n, shards[n]) for n in todo], samples, workers, scheduler, progress=(
            (lambda done, tokens: progress(resumed + done, len(shards),
                                           tokens / (time.perf_counter() - t0))) if progress else None))
        done_tokens, worker_loads = result["extracted_tokens"], result["worker_verifier_loads"]
        todo = []
    model = None
    for count, n in enumerate(todo, 1):
        if model is None:
            model = load_verifier(verifier_path, resolve_device(device), trust_remote_code)
            t0 = time.perf_counter()  # tokens/s measures extraction, not the load
        idx = shards[n]
        batch = [samples[i]["input_ids"] for i in idx]
        try:
            states = extract_batch(model, batch, aux_ids, pad_id)
        except torch.OutOfMemoryError:
            del model  # retries run in this process: give the memory back before the caller retries
            _release_memory()
            raise
        done_tokens += write_shard(hs_dir, n, idx, batch, states, dtype)
        if progress:
            progress(resumed + count, len(shards), done_tokens / (time.perf_counter() - t0))
    seconds = time.perf_counter() - t0
    del model

    torch.save(dict(freq), out / "token_freq.pt")
    file_digests = {f"hidden_states/{name}": sha for record in sorted(records.glob("*.json"))
                    for name, sha in json.loads(record.read_text())["files"].items()}
    shutil.rmtree(records)  # the manifest carries every file's digest from here on (store.publish takes them)
    hidden_size = get_text_hidden_size(verifier_path)
    stats = {
        "samples": len(samples),
        "tokens": sum(s["seq_len"] for s in samples),
        "extracted_tokens": done_tokens,
        "shards": len(shards),
        "resumed_shards": resumed,
        "loss_tokens": sum(freq.values()),
        "seconds": seconds,
        "tokens_per_s": done_tokens / seconds if seconds and done_tokens else 0.0,
        "bytes_per_token": bytes_per_token(len(aux_ids) + 1, hidden_size, dtype),
        "hidden_size": hidden_size,
        "backend": backend,
        "file_sha256": file_digests,  # hashed once, as each file was written
    }
    if worker_loads is not None:
        stats["worker_verifier_loads"] = worker_loads
    return stats


def write_shard(hs_dir: Path, n: int, idx: list[int], batch: list[list[int]], states: list[torch.Tensor],
                dtype: str) -> int:
    """One shard's files (temporary name, then rename), then its record with their sha256. Returns its tokens."""
    digests, tokens = {}, 0
    for i, ids, hs in zip(idx, batch, states):
        name = f"hs_{i}.safetensors"
        tmp = hs_dir / f".{name}.tmp"
        save_file({**_stored(hs, dtype), "token_ids": torch.tensor(ids, dtype=torch.long)}, str(tmp))
        os.replace(tmp, hs_dir / name)
        digests[name] = file_sha256(hs_dir / name)
        tokens += len(ids)
    record = hs_dir / SHARD_RECORDS / f"{n}.json"
    record.with_suffix(".tmp").write_text(json.dumps({"samples": idx, "files": digests}))
    os.replace(record.with_suffix(".tmp"), record)
    return tokens


def _stored(hs: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """The tensors of one sample's file. fp8 is hs-connectors' layout: e4m3 values + a per-token float32 scale
    (`hidden_states_scales`), which speculators' `--hidden-states-backend fp8` dequantizes when it loads."""
    if dtype == "fp8":
        from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

        values, scales = quantize_tensor_to_fp8(hs)
        return {"hidden_states": values.contiguous(), SCALES_KEY: scales.contiguous()}
    return {"hidden_states": hs.to(getattr(torch, dtype)).contiguous()}


def bytes_per_token(n_states: int, hidden_size: int, dtype: str) -> int:
    if dtype == "fp8":
        return n_states * hidden_size + 4
    return n_states * hidden_size * getattr(torch, dtype).itemsize


def _release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _shard_done(record: Path, idx: list[int], hs_dir: Path) -> bool:
    """A finished shard: its record lists these samples and every file still has the recorded digest."""
    try:
        rec = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    if rec.get("samples") != idx:
        return False
    return all((hs_dir / name).is_file() and file_sha256(hs_dir / name) == sha for name, sha in rec["files"].items())


def _save_dataset(samples: list[dict], out: Path) -> None:
    """speculators' dataset, with a content fingerprint (datasets draws a random one for in-memory data)."""
    from datasets import Dataset

    ds = Dataset.from_list(samples)
    fingerprint = hashlib.sha256(json.dumps(samples).encode()).hexdigest()[:16]
    ds = Dataset(ds.data, info=ds.info, fingerprint=fingerprint)
    ds.set_format("torch")
    ds.save_to_disk(str(out))


def get_text_hidden_size(verifier_path: str) -> int:
    from eaglet.verifier import read_config_dict, text_config_of

    return text_config_of(read_config_dict(Path(verifier_path)))["hidden_size"]


def token_freq(path: Path) -> Counter:
    return Counter(torch.load(path / "token_freq.pt", weights_only=True))
