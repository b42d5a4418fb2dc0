"""Every artifact's key in one place. A key is the digest of the artifact's inputs by content (upstream artifacts by
their own keys, files by their rows or bytes, parameters that change what is computed), the code version and the
store root. The key names the artifact in the store, and tasks.cache makes the same key the task's Prefect cache
key. tests/test_fingerprints.py walks every parameter through these functions."""

from __future__ import annotations

from pathlib import Path

import eaglet
from eaglet import store
from eaglet.capture import CAPTURE_VERSIONS
from eaglet.capture.engine import capture_engine_dtype
from eaglet.capture.rows import view_rows
from eaglet.capture.vllm import run_capture_settings
from eaglet.config import DataParams, RunConfig
from eaglet.data import row_digest, split_run_rows
from eaglet.drafts import registry
from eaglet.report.history import comparison_key as history_comparison_key
from eaglet.evaluate import serving
from eaglet.evaluate.smoke import held_out_prompts, machine_kind, smoke_max_model_len
from eaglet.evaluate.suites import load_suites
from eaglet.train.launch import cpu_dtype
from eaglet.train.warm_start import run_training
from eaglet.verifier import VerifierInfo
from eaglet.verifier.embedded import gguf_identity


def _key(kind: str, **inputs) -> str:
    """Artifact key = digest of the inputs, the code version and the store root (a cache hit must point at an
    artifact in *this* store)."""
    return store.digest({"kind": kind, "code": eaglet.CODE_VERSION, "root": str(store.store_root()), **inputs})


def embedded_key() -> str:
    return _key("verifier", gguf=gguf_identity())


def run_rows(data_file: str, cfg: RunConfig):
    """(training rows, held-out rows, counts, the fixed held-out file or None) of a run."""
    d = cfg.data
    return split_run_rows(data_file, d.eval_path, d.path, d.eval_fraction, d.seed, d.max_samples)


def data_key(data_file: str, cfg: RunConfig) -> str:
    """The rows themselves (digests, in digest order), not the file: reordering rows changes nothing, and a new
    row changes only what it has to."""
    if not Path(data_file).is_file() or (cfg.data.eval_path and not Path(cfg.data.eval_path).is_file()):
        return _key("data", missing=[data_file, cfg.data.eval_path])  # the task itself reports the problem
    train, held, _, _ = run_rows(data_file, cfg)
    return _key("data", train=store.digest([row_digest(m) for m in train]),
                eval=store.digest([row_digest(m) for m in held]))


def regen_key(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    d = cfg.data
    # sampled answers: one seed per conversation (eaglet.vllm.worker.request_seeds), not one seed for all of them
    seeding = {"seeding": "per-conversation"} if d.temperature > 0 else {}
    return _key("responses", verifier=verifier.fingerprint, data=Path(data_dir).name, max_new_tokens=d.max_new_tokens,
                temperature=d.temperature, n=d.responses_per_prompt, seed=d.seed, max_seq_len=d.max_seq_len,
                engine_dtype=capture_engine_dtype(cfg), **seeding)


def extraction_key(verifier: VerifierInfo, conversations_dir: str, cfg: RunConfig) -> str:
    """The hf backend's artifact: hidden states of given conversations (regenerated ones or the data's own)."""
    return _key("hidden_states", verifier=verifier.fingerprint, conversations=Path(conversations_dir).name,
                aux=verifier.aux_layer_ids, max_seq_len=cfg.data.max_seq_len, dtype=cfg.extraction.dtype,
                extractor=CAPTURE_VERSIONS["hf"])


def capture_content_key(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    """The key of the view that keeps every row's states (what a streamed view stands for)."""
    reasoning = {} if cfg.data.reasoning_in_loss else {"reasoning_in_loss": False}  # the view's masks (rows share)
    return _key("hidden_states", verifier=verifier.fingerprint, aux=verifier.aux_layer_ids,
                data=Path(data_dir).name, settings=run_capture_settings(verifier, cfg), **reasoning, **_tags(cfg))


def capture_key(verifier: VerifierInfo, data_dir: str, cfg: RunConfig, **_where) -> str:
    """The vllm backend's dataset view; its rows are keyed each on its own (eaglet.capture.rows). Which engine
    computes it, and from which plan, is not in it (an endpoint must serve this verifier's fingerprint)."""
    content = capture_content_key(verifier, data_dir, cfg)
    e = cfg.extraction
    if e.states == "keep" and e.disk_budget_gb is None:
        return content
    # a view with streamed samples links fewer files than the kept view of the same content (states_identity)
    return _key("hidden_states", content=content, states=e.states, disk_budget_gb=e.disk_budget_gb)


def states_identity(states_dir: str) -> str:
    """What training reads, by content: a dataset view's key, or for a view with streamed samples the key of the
    view that keeps them all (its rows.json `content`). A draft trained on streamed states is keyed like one
    trained on kept states, so either run reuses the other's vocabulary and draft."""
    return view_rows(Path(states_dir)).get("content") or Path(states_dir).name


def draft_settings(cfg: RunConfig) -> dict:
    """The draft's settings as keys see them: the architecture's say (DraftArchitecture.key_settings)."""
    return registry.get(cfg.draft.architecture).key_settings(cfg)


def draft_shape(verifier: VerifierInfo, cfg: RunConfig) -> str:
    """What a warm start must share with the draft it continues: verifier, layers it reads, draft settings."""
    like = registry.get(cfg.draft.architecture).reference(cfg)
    return store.digest({"verifier": verifier.fingerprint, "aux": verifier.aux_layer_ids, "like": like,
                         "draft": draft_settings(cfg)})


def init_identity(init_dir: str | None) -> str | None:
    """A stored draft is named by its content key; a directory of the user's by its weights' digest."""
    if init_dir is None:
        return None
    p = Path(init_dir)
    if p.parent == store.store_root() / "draft_ckpt":
        return p.name
    return store.file_sha256(p / "model.safetensors")[:16] if (p / "model.safetensors").is_file() else str(p)


def vocab_key(verifier: VerifierInfo, states_dir: str, init_dir: str | None, cfg: RunConfig) -> str:
    return _key("vocab", states=states_identity(states_dir), draft_vocab_size=cfg.draft.draft_vocab_size,
                kept_from=init_identity(init_dir))


def training_key(verifier: VerifierInfo, states_dir: str, vocab_dir: str, init_dir: str | None,
                 cfg: RunConfig, data_dir: str | None = None, **_engines) -> str:
    """The settings training actually uses (eaglet.train.warm_start.run_training: a warm start's own epochs,
    learning rate, warm-up and replay; at their defaults, the keys of drafts trained before these levers existed);
    data_dir is not in the key: the states' key already names the data they were captured from."""
    from importlib.metadata import version


    arch = registry.get(cfg.draft.architecture)
    like = arch.reference(cfg)  # its content, not its path
    training = run_training(init_dir, cfg.training)
    warm = {"init", "warm_epochs", "warm_lr_fraction", "warm_warmup_steps", "warm_replay_fraction"}
    settings = training.model_dump(exclude=warm) | {"cpu_dtype": cpu_dtype(training.cpu_dtype),  # 'auto' resolved
                                                    "loss": arch.loss(cfg)}  # empty: the architecture's
    if init_dir and training.warm_replay_fraction < 1:  # a warm start on part of the rows
        settings["replay_fraction"] = training.warm_replay_fraction
    return _key("draft_ckpt", states=states_identity(states_dir), vocab=Path(vocab_dir).name, like=like,
                draft=draft_settings(cfg), training=settings, init=init_identity(init_dir),
                speculators=version("speculators"))


def export_kind(verifier: VerifierInfo, ckpt_dir: str, cfg: RunConfig) -> str:
    """The store kind of what vLLM loads: the architecture's (an EAGLE-3 draft's flat form: draft_flat)."""
    return registry.get(cfg.draft.architecture).export_kind


def export_key(verifier: VerifierInfo, ckpt_dir: str, cfg: RunConfig) -> str:
    arch = registry.get(cfg.draft.architecture)
    return _key(arch.export_kind, ckpt=Path(ckpt_dir).name, export=cfg.export.model_dump(),
                convert=arch.export_version)


def _tags(cfg: RunConfig) -> dict:
    """data.reasoning_tags where they are not the default (what tells reasoning apart: masks, shares, the split)."""
    tags = cfg.data.reasoning_tags
    return {} if tuple(tags) == DataParams.model_fields["reasoning_tags"].default else {"reasoning_tags": list(tags)}


def held_out_digest(data_dir: str, cfg: RunConfig) -> str:
    """The smoke prompts' digest: the baseline and the smoke results depend on them, not on the training rows (and
    on data.chat_template_kwargs, which render them, and the reasoning tags, which split their answers, when set)."""
    prompts, template = held_out_prompts(data_dir, cfg), cfg.data.chat_template_kwargs
    extra = ({"template": template} if template else {}) | _tags(cfg)
    return store.digest({"prompts": prompts, **extra} if extra else prompts)


def baseline_key(verifier: VerifierInfo, data_dir: str, cfg: RunConfig, **_engine) -> str:
    """The verifier alone on the held-out prompts: not the draft, not k, not which engine answered. The machine's
    kind is in the key: a speed measured on other hardware is not this one's (it is re-measured there)."""
    s = cfg.smoke
    return _key("baseline", verifier=verifier.fingerprint, prompts=held_out_digest(data_dir, cfg),
                max_tokens=s.max_tokens, dtype=s.dtype, max_model_len=smoke_max_model_len(cfg),
                machine=machine_kind())


def smoke_key(verifier: VerifierInfo, draft_dir: str, data_dir: str, baseline_dir: str, cfg: RunConfig,
              evaluation_dir: str | None = None) -> str:
    """evaluation_dir: the evaluation whose trained-k server answered the smoke test (its key holds the prompts and
    settings); a smoke test on its own engine keeps the key it always had."""
    parts = {"evaluation": Path(evaluation_dir).name} if evaluation_dir else {}
    return _key("smoke", verifier=verifier.fingerprint, draft=Path(draft_dir).name,
                prompts=held_out_digest(data_dir, cfg),
                baseline=Path(baseline_dir).name,
                smoke=cfg.smoke.model_dump(exclude={"min_acceptance", "min_speedup"})
                | {"num_speculative_tokens": registry.get(cfg.draft.architecture).k(cfg)}, **parts)


def comparison_key(verifier: VerifierInfo, data_dir: str, cfg: RunConfig) -> str:
    """Which acceptance figures compare (eaglet.report.history): same verifier, held-out prompts, smoke settings."""
    s = cfg.smoke
    return history_comparison_key(verifier.fingerprint, held_out_prompts(data_dir, cfg),
                                  registry.get(cfg.draft.architecture).k(cfg), s.max_tokens, s.dtype)


def suites_digest(cfg: RunConfig) -> str:
    """The evaluation prompts by content: each suite's name, source and prompts (after eval.prompts_per_suite)."""
    return store.digest([s.model_dump() for s in load_suites(cfg.eval.suites, cfg.eval.prompts_per_suite)])


def serving_baseline_key(verifier: VerifierInfo, cfg: RunConfig) -> str:
    """The verifier alone under load: not the draft, not k. The machine's kind is in the key (speeds are not
    portable)."""
    e = cfg.eval
    template = {"template": cfg.data.chat_template_kwargs} if cfg.data.chat_template_kwargs else {}
    return _key("serving_baseline", verifier=verifier.fingerprint, suites=suites_digest(cfg), max_tokens=e.max_tokens,
                levels=serving.levels(cfg), dtype=cfg.smoke.dtype, max_model_len=serving.max_model_len(cfg),
                machine=machine_kind(), **template)


def evaluation_key(verifier: VerifierInfo, draft_dir: str, ckpt_dir: str, baseline_dir: str, cfg: RunConfig,
                   data_dir: str, smoke_baseline: str | None = None) -> str:
    """The draft on the suites at each level and k, against the kept verifier-alone figures (their key names the
    suites, levels and settings), and the smoke test's answers from the trained k's server (its prompts and
    settings). The gate's thresholds are the report's, not the measurement's. smoke_baseline is not in it: its
    greedy answers (which split reasoning from the final answer) follow from the verifier and the smoke settings
    already here."""
    trained, s = registry.get(cfg.draft.architecture).k(cfg), cfg.smoke
    return _key("evaluation", verifier=verifier.fingerprint, draft=Path(draft_dir).name, lineage=Path(ckpt_dir).name,
                baseline=Path(baseline_dir).name, k=serving.k_values(cfg, trained), trained_k=trained,
                smoke={"prompts": held_out_digest(data_dir, cfg), "max_tokens": s.max_tokens})
