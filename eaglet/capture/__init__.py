"""Generation and capture: the training data of a draft, from the verifier, in speculators' on-disk format.

One interface, two backends; both write the same artifact through `eaglet.capture.shards` (dataset, per-sample
hidden-state files, token counts; resumable shard by shard):

  vllm  (eaglet.capture.vllm, engine, fleet)  one vLLM engine (or several: fleet) started with the
        `extract_hidden_states` method and the hidden-states connector answers the prompts *and* saves the hidden
        states of prompt + response in the same requests: the verifier is loaded once, and each token goes through
        it once. Without regeneration the same engine captures the given conversations prefill-only. The engine is
        a server (started by the flow, by `eaglet verifier serve`, or kept up by a team between runs), so the data
        pass is an HTTP client.
  hf    (eaglet.capture.hf, hf_forward, dask)  transformers forward passes over given conversations, in this
        process or over Dask workers: for verifiers vLLM cannot load, and for fan-out over many hosts.

Imports go one way: hf -> dask -> hf_forward -> (torch); vllm -> engine; everything -> shards.
"""

from __future__ import annotations

from eaglet.errors import EagletError
from eaglet.verifier.devices import visible_accelerators

# Part of the capture cache key: the backends agree to bf16 rounding, not bit for bit. Sampled vllm rows have a
# version of their own: before eaglet.capture.scheduler, vLLM's capture engine on CPU sampled unrelated tokens
# ("AHy meditate hal PERossible serum ..."; a draft trained on them reached 1.17), so no such row is reused.
# Greedy rows are bit-identical with and without that scheduler (measured) and keep theirs. vllm-row-3: each
# sampled answer has a seed of its own (eaglet.capture.vllm.sample_seed); row-2's answer j of every prompt shared one.
CAPTURE_VERSIONS = {"hf": "hf-1", "vllm": "vllm-row-1", "vllm-sampled": "vllm-row-3"}


def vllm_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("vllm") is not None


def resolve_backend(backend: str = "auto", device: str = "auto", tensor_parallel_size: int = 1, workers: int = 1,
                    scheduler: str | None = None, data_parallel_size: int = 1) -> str:
    """The backend a run will use ('auto' resolved), or one sentence saying which setting to change. Checked
    before any weights load."""
    gpus = visible_accelerators()
    if device.startswith("cuda") and not gpus:
        raise EagletError(f"extraction.device={device} but no CUDA device is visible; use 'auto' or 'cpu'")
    spread = workers > 1 or bool(scheduler)
    if backend == "auto":  # vLLM wherever it runs (CPU included): one verifier load for generation and capture
        backend = "vllm" if vllm_installed() and not spread and not (device == "cpu" and gpus) else "hf"
    if backend == "hf":
        if tensor_parallel_size > 1 or data_parallel_size > 1:
            raise EagletError("extraction.tensor_parallel_size and data_parallel_size apply to the vllm backend "
                              "(the hf backend spreads with extraction.workers); set extraction.backend=vllm, or both "
                              "to 1 for hf")
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
    if gpus and tensor_parallel_size * data_parallel_size > gpus:  # on CPU, engines share the cores
        raise EagletError(f"extraction.data_parallel_size={data_parallel_size} engines of tensor_parallel_size="
                          f"{tensor_parallel_size} need {tensor_parallel_size * data_parallel_size} GPUs; {gpus} "
                          "visible")
    if device.startswith("cuda:") and (tensor_parallel_size > 1 or data_parallel_size > 1):
        raise EagletError(f"extraction.device={device} pins one GPU but tensor_parallel_size="
                          f"{tensor_parallel_size} and data_parallel_size={data_parallel_size}; use device=auto "
                          "(CUDA_VISIBLE_DEVICES picks the GPUs)")
    return backend


def run_backend(cfg) -> str:
    """A run's backend: 'auto' resolved, and a verifier.endpoint is a vLLM engine; impossible settings refused."""
    e = cfg.extraction
    backend = "vllm" if cfg.verifier.endpoint and e.backend == "auto" else e.backend
    if cfg.verifier.endpoint and backend != "vllm":
        raise EagletError("verifier.endpoint is a vLLM capture server: it needs extraction.backend vllm or auto")
    if cfg.verifier.endpoint and e.data_parallel_size > 1:
        raise EagletError("extraction.data_parallel_size is the number of engines the run starts; with "
                          "verifier.endpoint it starts none: list the servers in verifier.endpoint instead")
    resolved = resolve_backend(backend, e.device, e.tensor_parallel_size, e.workers, e.scheduler_address,
                               e.data_parallel_size)
    if resolved != "vllm" and (e.states == "stream" or e.disk_budget_gb):
        what = "extraction.states=stream" if e.states == "stream" else "extraction.disk_budget_gb"
        raise EagletError(f"{what} streams states from a vLLM capture engine: it needs extraction.backend vllm "
                          f"(this run resolves to {resolved})")
    d = cfg.data
    if resolved != "vllm" and ((d.regenerate and d.regenerate_turns == "all") or d.chat_template_kwargs):
        what = "data.regenerate_turns=all" if d.regenerate_turns == "all" else "data.chat_template_kwargs"
        raise EagletError(f"{what} answers through the vllm capture backend (token ids rendered by eaglet): set "
                          f"extraction.backend=vllm (this run resolves to {resolved})")
    if e.states == "stream" and e.disk_budget_gb:
        raise EagletError("extraction.disk_budget_gb limits what extraction.states=keep stores; with states=stream "
                          "nothing is stored: drop one of the two")
    return resolved
