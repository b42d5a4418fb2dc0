"""Train a draft with speculators: its model, its Trainer, its CLI config, in this process.

We build the same `TrainConfig` the `speculators train` CLI would and call its `main`, so every training
choice (the architecture's own, loss, optimizer, checkpointing, resume) is speculators' own. On CPU, three hard-coded
accelerator calls are patched in `cpu_patches`, and the CPU-capable kernels are selected.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from eaglet.config import BF16_MIN_SPEEDUP, RunConfig, TrainingParams, loss_spec
from eaglet.drafts.base import DraftArchitecture
from eaglet.verifier import read_config_dict, text_config_of
from eaglet.verifier.devices import on_accelerator, visible_accelerators
from eaglet.train.argv import argv_value
from eaglet.train.cpu import cpu_patches, float32_muon, keep_log_handlers, lossless_checkpoints
from eaglet.train.metrics import MetricsRecorder, follow_metrics, metrics_end
from eaglet.train.stream import from_engine


@functools.lru_cache(maxsize=1)
def bf16_matmul_speedup() -> float:
    """How many times faster this CPU multiplies bf16 matrices than float32 ones, measured on a draft-shaped matmul
    (1024 tokens x 576 -> 1536, the MLP's up-projection for SmolLM2-135M's width): the best of 5 interleaved
    tries each, about half a second. Once per process."""
    import time

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 576, generator=gen), torch.randn(576, 1536, generator=gen)
    pairs = {torch.float32: (a, b), torch.bfloat16: (a.bfloat16(), b.bfloat16())}
    best = dict.fromkeys(pairs, float("inf"))
    for round_ in range(6):  # round 0 warms both kernels up and is not counted
        for dtype, (x, y) in pairs.items():
            t = time.perf_counter()
            for _ in range(4):
                x @ y
            if round_:
                best[dtype] = min(best[dtype], time.perf_counter() - t)
    return best[torch.float32] / best[torch.bfloat16]




def cpu_dtype(setting: str) -> str:
    """training.cpu_dtype resolved: 'auto' is bfloat16 where this CPU's bf16 matmuls are measured at least
    BF16_MIN_SPEEDUP times float32's speed (AMX, or native AVX-512 BF16 as on Zen 4), else float32."""
    if setting != "auto":
        return setting
    return "bfloat16" if bf16_matmul_speedup() >= BF16_MIN_SPEEDUP else "float32"


def speculators_argv(
    arch: DraftArchitecture,
    cfg: RunConfig,
    verifier_path: str,
    data_path: Path,
    vocab_dir: Path,
    save_path: Path,
    aux_ids: list[int],
    training: TrainingParams | None = None,
    trust_remote_code: bool = False,
    draft_config: Path | None = None,
    multimodal: bool = False,
    states_dtype: str = "bfloat16",
    init: Path | None = None,
    endpoint: str | None = None,
) -> list[str]:
    """The `speculators train` arguments for this run (also written to the artifact for reproduction): the draft
    architecture's own, then what every architecture shares. training: cfg.training as this run uses it (a warm
    start's own epochs and rate; eaglet.train.warm_start.run_training). endpoint: the capture engine that computes
    the states of samples the view does not hold (extraction.states)."""
    training = training or cfg.training
    argv = [
        *arch.speculators_args(cfg),
        "--verifier-name-or-path", verifier_path,
        "--data-path", str(data_path),
        "--save-path", str(save_path),
        "--log-dir", str(save_path / "logs"),
        "--target-layer-ids", *[str(i) for i in aux_ids],
        "--draft-vocab-size", str(cfg.draft.draft_vocab_size),
        "--d2t-path", str(vocab_dir / "d2t.npy"),
        "--t2d-path", str(vocab_dir / "t2d.npy"),
        "--epochs", str(training.epochs),
        "--lr", str(training.lr),
        "--optimizer", training.optimizer,
        "--scheduler-type", training.scheduler,
        "--scheduler-warmup-steps", str(training.warmup_steps),
        "--loss-fn", loss_spec(arch.loss(cfg)),
        "--total-seq-len", str(training.total_seq_len),
        "--train-data-ratio", "0.95",
        "--seed", str(training.seed),
        "--log-freq", "10",
    ]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    # a missing states file is an error unless an engine streams it (speculators would ask localhost:8000)
    argv += ["--vllm-endpoint", f"{endpoint}/v1", "--on-missing", "generate"] if endpoint else ["--on-missing", "raise"]
    if states_dtype == "fp8":  # hs-connectors' reader dequantizes e4m3 + per-token scales on load
        argv += ["--hidden-states-backend", "fp8"]
    if multimodal and "--mask-token-id" not in argv:
        # speculators resolves a mask token (used by DFlash/P-EAGLE, never by EAGLE-3) through AutoProcessor,
        # which for Kimi-K2.5 / VL verifiers loads the image processor (torchvision); an explicit id skips it.
        argv += ["--mask-token-id", str(_any_special_token_id(verifier_path))]
    if init is not None:  # a warm start: speculators takes every shape from the checkpoint and refuses shaping flags
        argv += ["--from-pretrained", str(init)]
    elif draft_config is not None:  # shapes from a reference draft (draft.like) instead of the verifier
        argv += ["--draft-config", str(draft_config)]  # speculators refuses the shaping flags beside it
    else:
        argv += arch.shape_args(cfg)
    if on_accelerator():
        argv += ["--hidden-states-dtype", "bfloat16"]  # GPU defaults: flex attention, fused loss
    else:
        argv += [
            "--draft-attn-impl", "sdpa",  # flex attention has no CPU backward
            "--loss-implementation", "eager",  # the fused loss needs Triton
            "--hidden-states-dtype", cpu_dtype(training.cpu_dtype),
            "--num-workers", "0",
        ]
    return argv


def _any_special_token_id(verifier_path: str) -> int:

    cfg = read_config_dict(Path(verifier_path))
    text = text_config_of(cfg)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = text.get(name, cfg.get(name))
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def torchrun_command(argv_file: Path, metrics_file: Path | None, nproc: int) -> list[str]:
    """One node, one rank per GPU, torchrun's standalone rendezvous; every rank runs eaglet.train.rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "eaglet.train.rank", str(argv_file)]
    return cmd + ([str(metrics_file)] if metrics_file else [])


def torchrun_argv(argv: list[str]) -> list[str]:
    """speculators shards the draft over the ranks only when asked (FSDP `fully_shard`)."""
    return argv if "--fsdp-shard" in argv else [*argv, "--fsdp-shard"]


STREAM_ENV = "EAGLET_STREAM_FROM"  # a torchrun rank's `stream` (train_draft), as JSON


def torchrun_env(nproc: int, stream: dict | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if stream:
        env[STREAM_ENV] = json.dumps(stream)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # torchrun's default is 1
    return env


def _train_with_torchrun(argv: list[str], metrics_file: Path | None, on_metrics, nproc: int,
                         stream: dict | None) -> None:
    save_path = Path(argv_value(argv, "--save-path"))
    save_path.mkdir(parents=True, exist_ok=True)
    argv_file = save_path.parent / "torchrun_argv.json"
    argv_file.write_text(json.dumps(torchrun_argv(argv)))
    done = threading.Event()
    follower = threading.Thread(target=follow_metrics, args=(metrics_file, on_metrics, done,
                                                             metrics_end(metrics_file)), daemon=True) \
        if metrics_file and on_metrics else None
    if follower:
        follower.start()
    try:
        proc = subprocess.run(torchrun_command(argv_file, metrics_file, nproc), env=torchrun_env(nproc, stream),
                              capture_output=True, text=True)
    finally:
        done.set()
        if follower:
            follower.join()
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun ({nproc} ranks) failed with exit {proc.returncode}:\n"
                           + (proc.stdout + proc.stderr)[-4000:])


def train_draft(argv: list[str], metrics_file: Path | None = None,
                on_metrics: Callable[[dict], None] | None = None, nproc: int | None = None,
                stream: dict | None = None) -> None:
    """Run speculators' training; its metrics are appended to metrics_file (a resumed run continues it).
    nproc: ranks (default: the visible GPUs). Above 1, torchrun launches them (speculators shards the draft with
    FSDP); otherwise speculators runs in this process. Either way a rerun resumes from the last epoch in
    --save-path. stream: {"served_name", "dtype"} of the engine at --vllm-endpoint (eaglet.train.stream)."""
    nproc = visible_accelerators() if nproc is None else nproc
    if nproc > 1:
        return _train_with_torchrun(argv, metrics_file, on_metrics, nproc, stream)
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(argv)
    recorder = MetricsRecorder(metrics_file, on_metrics) if metrics_file else None
    root = logging.getLogger()
    if recorder:
        root.addHandler(recorder)
    try:
        with lossless_checkpoints(), keep_log_handlers(), from_engine(stream):
            if on_accelerator():
                main(cfg)
            else:
                f32 = argv_value(argv, "--hidden-states-dtype") == "float32"
                with cpu_patches(), float32_muon() if f32 else contextlib.nullcontext():
                    main(cfg)
    finally:
        if recorder:
            root.removeHandler(recorder)
            recorder.close()
