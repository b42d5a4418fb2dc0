"""The verifier engine of the data pass: a vLLM OpenAI-compatible server started with the `extract_hidden_states`
speculative method and the hidden-states connector. It generates as usual and, per request, saves the hidden
states of the requested layers to a safetensors file in its storage directory.

The flow starts one per cold run (its load is the run's one verifier load) and stops it before training;
`eaglet verifier serve` starts one that stays up, so nightly runs pointed at it (`verifier.endpoint`) load
nothing. The served model name carries the verifier fingerprint and the captured layers, which is how a run
knows that an endpoint serves *its* verifier with *its* layers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel

from eaglet.config import RunConfig
from eaglet.errors import EagletError
from eaglet.vllm.process import stop_group
from eaglet.verifier.devices import on_accelerator
from eaglet.vllm import vllm_env
from eaglet.vllm.server import free_port, healthy
from eaglet.evaluate.smoke import smoke_max_model_len
from eaglet.verifier.devices import visible_accelerators

log = logging.getLogger("eaglet.vllm")


class EngineError(RuntimeError):
    """The engine failed to start or died (transient failures are retried by the caller)."""


class Engine(BaseModel):
    """A running capture server, by reference: what the data pass needs to use it."""

    endpoint: str
    served_name: str
    storage: str | None = None  # the connector's directory, when this process started it (its files are read by
    # the path each response names: shared storage, mounted at the same path, when the server is remote)
    max_model_len: int
    pid: int | None = None  # set when this process started it
    load_seconds: float = 0.0


def served_name(fingerprint: str, layers: list[int], dtype: str) -> str:
    return f"eaglet-capture-{fingerprint}-L{'_'.join(str(i) for i in layers)}-{dtype}"


def engine_dtype(setting: str, device: str = "auto") -> str:
    """extraction.engine_dtype resolved: 'auto' is float32 when vLLM runs on the CPU, where the smoke test measures
    the draft in float32 (its lossless check), so the draft trains on the states it is measured with; bfloat16 on
    GPUs."""
    if setting != "auto":
        return setting

    return "float32" if device == "cpu" or not on_accelerator() else "bfloat16"


def capture_layers(aux_ids: list[int], num_layers: int) -> list[int]:
    """vLLM layer ids: aux ids ascending, then L (the last layer's output before the final norm) = the hf
    backend's [T, n_aux+1, H]."""
    return sorted(aux_ids) + [num_layers]


def connector_config(storage: Path) -> dict:
    from vllm.platforms import current_platform

    connector = {"kv_connector": "ExampleHiddenStatesConnector"}
    if current_platform.is_cpu():  # upstream copies through CUDA; see eaglet/capture/vllm_cpu_connector.py
        connector = {"kv_connector": "CpuHiddenStatesConnector",
                     "kv_connector_module_path": "eaglet.capture.vllm_cpu_connector"}
    return {**connector, "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


def server_argv(verifier: str, name: str, layers: list[int], storage: Path, max_model_len: int, host: str, port: int,
                tensor_parallel_size: int = 1, trust_remote_code: bool = False, dtype: str = "bfloat16",
                plain_decode: bool | None = None) -> list[str]:
    """plain_decode: schedule requests without the capture method's placeholder draft token
    (eaglet.capture.scheduler); None = on a CPU, where that token doubles the decoding work."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",  # vllm-cpu's `vllm` script does not start
        "--model", verifier, "--served-model-name", name, "--host", host, "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--max-num-batched-tokens", str(max(max_model_len, 8192)),
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--seed", "0",
        "--enforce-eager",
        "--no-enable-chunked-prefill",  # extract_hidden_states: a request's prompt states in one step
        "--no-enable-prefix-caching",  # every sequence computed from its own tokens, whatever ran before it
        "--speculative-config", json.dumps(spec),
        "--kv-transfer-config", json.dumps(connector_config(storage)),
        "--disable-uvicorn-access-log",
    ]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    if plain_decode is None:
        from vllm.platforms import current_platform

        plain_decode = current_platform.is_cpu()
    if plain_decode:
        argv += ["--scheduler-cls", "eaglet.capture.scheduler.CaptureScheduler"]
    return argv


def start_engine(verifier: str, fingerprint: str, layers: list[int], storage: Path, max_model_len: int,
                 tensor_parallel_size: int = 1, device: str = "auto", trust_remote_code: bool = False,
                 host: str = "127.0.0.1", port: int | None = None, timeout: float = 3600,
                 dtype: str = "bfloat16", plain_decode: bool | None = None) -> Engine:
    """Start the server in its own session (its engine processes stop with it) and wait until it answers.
    Its log is storage/server.log."""
    storage.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    name = served_name(fingerprint, layers, dtype)
    env = vllm_env()
    env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "600")  # idle connections kept (eaglet.capture.vllm._post)
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    log_file = storage / "server.log"
    t0 = time.perf_counter()
    argv = server_argv(verifier, name, layers, storage, max_model_len, host, port, tensor_parallel_size,
                       trust_remote_code, dtype, plain_decode)
    with log_file.open("w") as out:  # through the guard: the server must not outlive this process, even a kill -9
        proc = subprocess.Popen([sys.executable, "-m", "eaglet.capture.engine", str(os.getpid()), *argv],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    engine = Engine(endpoint=f"http://{host}:{port}", served_name=name, storage=str(storage),
                    max_model_len=max_model_len, pid=proc.pid)
    try:
        while not healthy(engine.endpoint):
            if proc.poll() is not None:
                raise EngineError(f"the vLLM server exited (code {proc.returncode}) while loading {verifier}; "
                                  f"last output:\n{_tail(log_file)}")
            if time.perf_counter() - t0 > timeout:
                raise EngineError(f"the vLLM server did not answer within {timeout:.0f} s; last output:\n"
                                  f"{_tail(log_file)}")
            time.sleep(0.5)
    except BaseException:
        stop_engine(engine)
        raise
    engine.load_seconds = round(time.perf_counter() - t0, 2)
    log.info(f"verifier engine up at {engine.endpoint} after {engine.load_seconds:.0f} s (one load)")
    return engine


def stop_engine(engine: Engine) -> None:
    """Stop an engine this process started (its guard's process group; eaglet.vllm.stop_group); an attached
    server (pid None) is its owner's to stop."""
    if engine.pid is None:
        return
    stop_group(engine.pid)
    engine.pid = None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def attach(endpoint: str, fingerprint: str, layers: list[int], max_model_len: int, dtype: str) -> Engine:
    """A running server, checked before any work: it must answer, serve this verifier (fingerprint) with these
    layers and fit the run's sequences; one sentence otherwise. (eaglet.capture.vllm.probe then checks that its
    capture files are readable here.)"""
    import httpx

    endpoint = endpoint.rstrip("/")
    want = served_name(fingerprint, layers, dtype)
    try:
        models = httpx.get(f"{endpoint}/v1/models", timeout=30).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise EagletError(f"verifier.endpoint {endpoint} does not answer as a vLLM server ({e}); start one with "
                          "`eaglet verifier serve`") from None
    names = [m.get("id") for m in models]
    if want not in names:
        served = ", ".join(str(n) for n in names)
        if any(str(n).startswith(f"eaglet-capture-{fingerprint}-") for n in names):
            why = f"it captures other layers or in another dtype ({served}; this run needs {want})"
        elif any(str(n).startswith("eaglet-capture-") for n in names):
            why = f"it serves another checkpoint ({served}; verifier.path has fingerprint {fingerprint})"
        else:
            why = f"it serves {served} without the capture method"
        raise EagletError(f"verifier.endpoint {endpoint} cannot be used: {why}; start it with "
                          f"`eaglet verifier serve --verifier {{verifier.path}}` and the run's aux layer ids")
    model = next(m for m in models if m.get("id") == want)
    served_len = int(model.get("max_model_len") or 0)
    if served_len and served_len < max_model_len:
        raise EagletError(f"verifier.endpoint {endpoint} serves at most {served_len} tokens per sequence; this run "
                          f"needs {max_model_len} (data.max_seq_len + data.max_new_tokens): restart it with "
                          f"--max-model-len {max_model_len}")
    return Engine(endpoint=endpoint, served_name=want, max_model_len=served_len or max_model_len)


def _guard(parent: int, argv: list[str]) -> int:
    """`python -m eaglet.capture.engine PARENT_PID ARGV...`: run the server in this process group and take the
    whole group down when PARENT_PID is gone (a verifier engine holds GPUs; an orphan would hold them for good)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stop_engine signals the group: the server first, then us
    server = subprocess.Popen(argv, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    while server.poll() is None:
        if os.getppid() != parent:
            os.killpg(0, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            finally:
                os.killpg(0, signal.SIGKILL)
        time.sleep(1)
    return server.returncode



def capture_engine_dtype(cfg: RunConfig) -> str:
    """The capture engine's --dtype for a run (extraction.engine_dtype resolved for its device)."""
    return engine_dtype(cfg.extraction.engine_dtype, cfg.extraction.device)


def engine_max_model_len(cfg: RunConfig) -> int:
    """The longest sequence the data pass needs (what a served engine is checked against)."""
    return cfg.data.max_seq_len + (cfg.data.max_new_tokens if cfg.data.regenerate else 1)


def started_engine_max_model_len(cfg: RunConfig) -> int:
    """What an engine eaglet starts holds: the data pass's sequences and the smoke test's, so the same engine can
    answer for the smoke baseline (baseline_engine_fits) even where the training answers are shorter than the
    smoke test's (data.max_new_tokens < smoke.max_tokens)."""
    return max(engine_max_model_len(cfg), smoke_max_model_len(cfg) if cfg.smoke.enabled else 0)


def baseline_engine_fits(engines: list[Engine] | None, cfg: RunConfig) -> bool:
    """Whether the data pass's engines can give the smoke test its baseline: they compute in the smoke test's dtype
    and hold a held-out prompt with smoke.max_tokens of answer."""
    return (bool(engines) and cfg.smoke.enabled and capture_engine_dtype(cfg) == cfg.smoke.dtype
            and min(e.max_model_len for e in engines) >= smoke_max_model_len(cfg))


def attach_for_run(verifier, cfg: RunConfig) -> list[Engine]:
    """verifier.endpoint's servers checked for this run: this verifier's fingerprint, the run's layers, its
    lengths."""
    layers = capture_layers(verifier.aux_layer_ids, verifier.num_layers)
    return [attach(url, verifier.fingerprint, layers, engine_max_model_len(cfg), capture_engine_dtype(cfg))
            for url in cfg.verifier.endpoint]


def engine_devices(index: int, tensor_parallel_size: int, device: str) -> str:
    """The device setting of engine `index` of a run's data_parallel_size: its own tensor_parallel_size GPUs (a
    slice of the visible ones), or the run's setting where there is no GPU to split."""
    if visible_accelerators() and device == "auto":
        first = index * tensor_parallel_size
        return "cuda:" + ",".join(str(first + g) for g in range(tensor_parallel_size))
    return device


def start_for_run(verifier, cfg: RunConfig, storage: Path) -> list[Engine]:
    """The run's verifier loads: extraction.data_parallel_size capture engines (started side by side, each sized
    for the data pass and the smoke baseline, each with its own storage directory, `storage`-i); all or none."""
    from concurrent.futures import ThreadPoolExecutor

    e = cfg.extraction
    layers = capture_layers(verifier.aux_layer_ids, verifier.num_layers)

    def start(i: int) -> Engine:
        return start_engine(verifier.path, verifier.fingerprint, layers, storage.with_name(f"{storage.name}-{i}"),
                            started_engine_max_model_len(cfg), e.tensor_parallel_size,
                            engine_devices(i, e.tensor_parallel_size, e.device), verifier.trust_remote_code,
                            dtype=capture_engine_dtype(cfg))

    with ThreadPoolExecutor(e.data_parallel_size) as pool:
        futures = [pool.submit(start, i) for i in range(e.data_parallel_size)]
    errors = [f.exception() for f in futures]
    started = [f.result() for f, err in zip(futures, errors) if err is None]
    if any(errors):
        stop_for_run(started)
        raise next(err for err in errors if err)
    return started


def stop_for_run(engines: list[Engine] | None) -> None:
    """Stop the engines this run started (an attached endpoint is its owner's) and drop their scratch."""
    for engine in engines or []:
        if engine.pid is not None:
            stop_engine(engine)
            if engine.storage:
                shutil.rmtree(engine.storage, ignore_errors=True)



def loading_summary(cfg: RunConfig) -> str:
    e = cfg.extraction
    return (f"loading the verifier into {e.data_parallel_size} vLLM capture engine(s) (tensor parallel "
            f"{e.tensor_parallel_size} each)")


def loaded_summary(fleet: list[Engine]) -> str:
    """Which engines the run uses and what their loads cost (an attached server's: nothing)."""
    if all(e.pid is None for e in fleet):
        return f"using the verifier engines at {', '.join(e.endpoint for e in fleet)}: no load"
    return "verifier loaded in " + ", ".join(f"{e.load_seconds:.1f} s" for e in fleet)


def first_answering(fleet: list[Engine]) -> Engine | None:
    return next((e for e in fleet if healthy(e.endpoint)), None)


def keep_one(fleet: list[Engine]) -> list[Engine]:
    """The first engine that answers stays up (training streams from one: speculators' client takes one endpoint);
    the others stop now rather than hold their devices through training."""
    source = first_answering(fleet)
    stop_for_run([e for e in fleet if e is not source])
    return [source] if source else []


class RunEngines:
    """The capture engines of one run, from load-verifier to their last use: the data pass and the smoke baseline,
    or training when it streams states. Whatever is still up stops when the run leaves the block, failed or not."""

    def __init__(self) -> None:
        self.fleet: list[Engine] | None = None

    def __enter__(self) -> RunEngines:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def hold(self, fleet: list[Engine]) -> list[Engine]:
        """The engines up now (load-verifier's, or those stop-spare-engines kept)."""
        self.fleet = fleet
        return fleet

    def stop(self) -> None:
        stop_for_run(self.fleet)
        self.fleet = None

    def give_baseline(self, cfg: RunConfig) -> bool:
        """Whether the engines up can answer for the smoke baseline (baseline_engine_fits)."""
        return baseline_engine_fits(self.fleet, cfg)


if __name__ == "__main__":
    sys.exit(_guard(int(sys.argv[1]), sys.argv[2:]))
