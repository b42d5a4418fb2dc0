"""The training stage top to bottom: speculators trains in `work_dir/checkpoints` (resuming from the last whole
epoch), the epoch whose validation predicts the longest acceptance becomes the draft, and the draft records its
lineage and its simulated decoding."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from eaglet.capture.rows import view_rows
from eaglet.config import RunConfig
from eaglet.drafts.base import DraftArchitecture
from eaglet.drafts.checkpoint import write_json
from eaglet.train.checkpoints import (best_checkpoint, discard_incomplete_checkpoints, write_delivered,
                                      write_final_draft)
from eaglet.train.launch import BF16_MIN_SPEEDUP, bf16_matmul_speedup, cpu_dtype, speculators_argv, train_draft
from eaglet.train.lineage import write_lineage
from eaglet.train.metrics import METRICS_FILE, training_monitor
from eaglet.train.replay import REPLAY_VIEW, training_view
from eaglet.train.stream import requests_served
from eaglet.train.warm_start import run_training, warm_start_weights
from eaglet.verifier import VerifierInfo
from eaglet.verifier.devices import on_accelerator

STREAM_FILE = "streamed.json"  # in a draft_ckpt artifact trained on streamed states: what the engine computed
ARGV_FILE = "speculators_train_argv.json"  # in a draft_ckpt artifact: the run, reproducible with `speculators train`


def train_stage(arch: DraftArchitecture, work_dir: Path, verifier: VerifierInfo, states_dir: Path, vocab_dir: Path,
                init_dir: Path | None, train_file: Path, cfg: RunConfig, log: logging.Logger | logging.LoggerAdapter,
                progress: Callable[..., None], engine=None) -> dict | None:
    """Train into work_dir (the draft_ckpt artifact being built): the top level is the delivered draft, every
    epoch stays under checkpoints/. Returns the simulated decoding on the validation rows (None if not possible).
    engine: the capture engine (eaglet.capture.engine.Engine) that computes the states of the view's streamed
    samples each time training reads one (eaglet.train.stream); needed when the view has any."""
    streamed = len(view_rows(states_dir)["streamed"])
    if streamed and engine is None:
        raise RuntimeError(f"{streamed} rows of {states_dir.name} are streamed and no capture engine is up")
    stream = {"served_name": engine.served_name, "dtype": cfg.extraction.dtype} if streamed else None
    training = run_training(init_dir, cfg.training)
    work = work_dir / "checkpoints"  # kept across attempts: speculators resumes from the last epoch in it
    for note in discard_incomplete_checkpoints(work):
        log.warning(f"discarded an incomplete checkpoint ({note}); resuming from the one before")
    layer_config = None
    reference = arch.reference_layer_config(cfg) if not init_dir else None
    if reference:  # draft.like: the reference draft's layer shapes instead of the verifier's
        layer_config = work_dir / "draft_layer_config.json"
        write_json(layer_config, reference)
    data_path = states_dir
    shutil.rmtree(work_dir / REPLAY_VIEW, ignore_errors=True)  # a resumed attempt rebuilds the same view
    if init_dir and training.warm_replay_fraction < 1:
        view = training_view(states_dir, init_dir, training.warm_replay_fraction, work_dir / REPLAY_VIEW)
        if view:
            data_path = work_dir / REPLAY_VIEW
            log.info(f"warm start trains on {view['rows']} rows: {view['new']} its lineage never saw and "
                     f"{view['replayed']} replayed (training.warm_replay_fraction {training.warm_replay_fraction})")
    argv = speculators_argv(arch, cfg, verifier.path, data_path, vocab_dir, work, verifier.aux_layer_ids, training,
                            verifier.trust_remote_code, draft_config=layer_config,
                            multimodal=verifier.nested_text_config, states_dtype=cfg.extraction.dtype,
                            init=warm_start_weights(init_dir) if init_dir else None,
                            endpoint=engine.endpoint if stream else None)
    (work_dir / ARGV_FILE).write_text(json.dumps(argv))
    if training.cpu_dtype == "auto" and not on_accelerator():
        log.info(f"training in {cpu_dtype('auto')} on this CPU: its bf16 matmuls run {bf16_matmul_speedup():.2f}x "
                 f"float32's (bf16 from {BF16_MIN_SPEEDUP}x; training.cpu_dtype overrides)")
    if stream:
        log.info(f"{streamed} rows stream their states from the capture engine at {engine.endpoint} (a verifier "
                 "forward pass each time training reads one)")
        served_before = requests_served(engine.endpoint)
    train_draft(argv, work_dir / METRICS_FILE, training_monitor(log, progress, training.epochs, arch.score),
                stream=stream)

    best, predicted = best_checkpoint(work, work_dir / METRICS_FILE, arch.score)
    if predicted is not None:
        log.info(f"epoch {int(best.name) + 1} of {training.epochs} predicts the longest acceptance "
                 f"({predicted:.3f}): it is the draft")
    write_final_draft(best, work_dir)
    write_delivered(work_dir, best, predicted)
    write_lineage(work_dir, train_file, init_dir, view_rows(states_dir)["rows"] or None)
    try:  # what vLLM should measure: decoding simulated on the validation rows, where the architecture can
        sim = arch.simulate(best, argv, work_dir / "acceptance.json", stream)
    except Exception as e:  # a figure for the report, not a reason to lose the training
        log.warning(f"could not simulate decoding on the validation rows: {type(e).__name__}: {e}")
        sim = None
    shutil.rmtree(work_dir / REPLAY_VIEW, ignore_errors=True)  # links only: the rows stay in the store
    if stream:  # the verifier forward passes training and its simulated decoding asked the engine for
        served_after = requests_served(engine.endpoint)
        requests = served_after - served_before if None not in (served_before, served_after) else None
        (work_dir / STREAM_FILE).write_text(json.dumps({"rows_streamed": streamed, "engine_requests": requests,
                                                        "epochs": training.epochs}))
        log.info(f"training asked the capture engine for {requests} forward passes")
    if sim:
        log.info(f"decoding simulated on {sim['rows']} validation rows: acceptance length "
                 f"{sim['chain_in_vocab']:.3f} (the position average {sim['position_average']:.3f})")
    return sim
