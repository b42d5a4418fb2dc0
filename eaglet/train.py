"""Train an EAGLE-3 draft with speculators: its model, its Trainer, its CLI config, in this process.

We build the same `TrainConfig` the `speculators train` CLI would and call its `main`, so every training
choice (TTT steps, loss, optimizer, checkpointing, resume) is speculators' own. On CPU, three hard-coded
accelerator calls are patched in `cpu_patches`, and the CPU-capable kernels are selected.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from eaglet.config import DraftParams, TrainingParams, loss_spec
from eaglet.errors import EagletError


def _newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's orthogonalisation (torch/optim/_muon.py `_zeropower_via_newtonschulz`), in float32.
    Upstream casts the update to bfloat16 first, made for GPUs; on a CPU without AMX its bf16 matmuls run at about
    half float32's speed, and the draft's Muon step cost ~30% of a float32 training step."""
    if grad.ndim != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


@contextlib.contextmanager
def float32_muon():
    import torch.optim._muon as muon

    saved = muon._zeropower_via_newtonschulz
    muon._zeropower_via_newtonschulz = _newton_schulz_float32
    try:
        yield
    finally:
        muon._zeropower_via_newtonschulz = saved


@contextlib.contextmanager
def cpu_patches():
    """speculators 0.9.0 assumes an accelerator in four places; on CPU we point them at the CPU.

    - speculators.train.trainer.get_local_rank() returns the int 0, which `.to()` reads as cuda:0.
    - speculators.train.checkpointer.get_current_device() falls back to "cuda:0" when resuming.
    - torch.accelerator.synchronize() raises when there is no accelerator (used by the step timer).
    - Trainer.device_type falls back to "cuda", so `torch.autocast` is silently disabled on CPU; with
      "cpu" it autocasts to --hidden-states-dtype (bf16: 1.55x float32's tokens/s with AMX; see `cpu_dtype`).
    Not a fix but a CPU speed-up: the draft's attention skips the keys its packed TTT mask excludes
    (eaglet.ttt_attention).
    """
    from eaglet.ttt_attention import chunked_ttt_attention

    import speculators.train.checkpointer as ckpt
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer

    class CPUTrainer(trainer.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.device_type = "cpu"

    saved = (trainer.get_local_rank, ckpt.get_current_device, torch.accelerator.synchronize, cli.Trainer)
    trainer.get_local_rank = lambda: "cpu"
    ckpt.get_current_device = lambda: "cpu"
    torch.accelerator.synchronize = lambda *a, **k: None
    cli.Trainer = CPUTrainer
    try:
        with chunked_ttt_attention():
            yield
    finally:
        trainer.get_local_rank, ckpt.get_current_device, torch.accelerator.synchronize, cli.Trainer = saved


@contextlib.contextmanager
def keep_log_handlers():
    """speculators' `setup_metric_logger` calls `logging.config.dictConfig`, which first flushes and closes every
    existing handler while holding logging's module lock. Prefect's API log handler flushes by waiting for its
    worker threads, and one of those may be waiting for that very lock (creating a logger): the run deadlocks.
    Seen once in a demo run (no log line for 19 minutes; the main thread in `APILogHandler.flush` under
    `dictConfig`, a Prefect worker in `logging.getLogger`). speculators' loggers are configured the same way,
    minus the clearing of handlers that are not its own."""
    import logging.config

    saved = logging.config._clearExistingHandlers
    logging.config._clearExistingHandlers = lambda: None
    try:
        yield
    finally:
        logging.config._clearExistingHandlers = saved


@contextlib.contextmanager
def lossless_checkpoints():
    """speculators 0.9.0 saves each epoch checkpoint (weights and optimizer state) in bfloat16 while training
    keeps float32, so a run resumed from one continues from rounded state and ends elsewhere (measured on the
    tiny verifier, 3 epochs: weights 0.2-0.6% apart). Saved in float32, a run killed and resumed ends
    bit-identical to an uninterrupted one; `write_final_draft` rounds the delivered draft to bfloat16 exactly as
    speculators' save would have."""
    import speculators.train.checkpointer as ckpt

    originals = {cls: cls.save_checkpoint for cls in (ckpt.SingleGPUCheckpointer, ckpt.DistributedCheckpointer)}

    def float32(save):
        return lambda self, model, optimizer, epoch, float_dtype=None: save(self, model, optimizer, epoch,
                                                                             float_dtype=torch.float32)

    for cls, save in originals.items():
        cls.save_checkpoint = float32(save)
    try:
        yield
    finally:
        for cls, save in originals.items():
            cls.save_checkpoint = save


def write_final_draft(epoch_dir: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """The delivered speculators checkpoint: the last epoch's weights in `dtype` (speculators' own conversion)."""
    from safetensors.torch import load_file, save_file
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype

    shutil.copy(epoch_dir / "config.json", out / "config.json")
    if (epoch_dir / "val_metrics.json").exists():
        shutil.copy(epoch_dir / "val_metrics.json", out / "val_metrics.json")
    state = convert_float_dtype(load_file(str(epoch_dir / "model.safetensors")), dtype)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    patch_config_dtype(out / "config.json", dtype)


def on_accelerator() -> bool:
    return torch.accelerator.current_accelerator(check_available=True) is not None


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


# bf16 training where a bf16 matmul runs at least this many times float32's speed. Measured: a 2-core Zen 4 EPYC
# (native AVX-512 BF16) 2.1-3.1x in four processes, where 3 demo epochs trained 1.59x faster in bf16 (488 s against
# 778 s, acceptance 1.642 against 1.639); a 2-core Xeon with AVX-512 BF16 but no AMX 0.55x on a larger matmul (844 s
# bf16 against 620 s float32); a Zen 3 EPYC has no AVX-512 at all. 1.5 lies well between the kinds measured, so
# timing noise does not flip the choice.
BF16_MIN_SPEEDUP = 1.5


def cpu_dtype(setting: str) -> str:
    """training.cpu_dtype resolved: 'auto' is bfloat16 where this CPU's bf16 matmuls are measured at least
    BF16_MIN_SPEEDUP times float32's speed (AMX, or native AVX-512 BF16 as on Zen 4), else float32."""
    if setting != "auto":
        return setting
    return "bfloat16" if bf16_matmul_speedup() >= BF16_MIN_SPEEDUP else "float32"


def speculators_argv(
    verifier_path: str,
    data_path: Path,
    vocab_dir: Path,
    save_path: Path,
    aux_ids: list[int],
    draft_vocab_size: int,
    draft: DraftParams,
    training: TrainingParams,
    trust_remote_code: bool = False,
    draft_config: Path | None = None,
    multimodal: bool = False,
    states_dtype: str = "bfloat16",
    init: Path | None = None,
) -> list[str]:
    """The `speculators train` arguments for this run (also written to the artifact for reproduction)."""
    flag = lambda name, on: f"--{name}" if on else f"--no-{name}"  # noqa: E731
    argv = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", verifier_path,
        "--data-path", str(data_path),
        "--save-path", str(save_path),
        "--log-dir", str(save_path / "logs"),
        "--target-layer-ids", *[str(i) for i in aux_ids],
        "--draft-vocab-size", str(draft_vocab_size),
        "--d2t-path", str(vocab_dir / "d2t.npy"),
        "--t2d-path", str(vocab_dir / "t2d.npy"),
        flag("norm-before-residual", draft.norm_before_residual),
        flag("norm-before-fc", draft.norm_before_fc),
        flag("norm-output", draft.norm_output),
        "--epochs", str(training.epochs),
        "--lr", str(training.lr),
        "--optimizer", training.optimizer,
        "--scheduler-type", training.scheduler,
        "--scheduler-warmup-steps", str(training.warmup_steps),
        "--ttt-steps", str(training.ttt_steps),
        "--ttt-step-loss-decay", str(training.ttt_step_loss_decay),
        "--loss-fn", loss_spec(training.loss),
        "--total-seq-len", str(training.total_seq_len),
        "--train-data-ratio", "0.95",
        "--seed", str(training.seed),
        "--log-freq", "10",
    ]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    if states_dtype == "fp8":  # hs-connectors' reader dequantizes e4m3 + per-token scales on load
        argv += ["--hidden-states-backend", "fp8"]
    if multimodal:
        # speculators resolves a mask token (used by DFlash/P-EAGLE, never by EAGLE-3) through AutoProcessor,
        # which for Kimi-K2.5 / VL verifiers loads the image processor (torchvision); an explicit id skips it.
        argv += ["--mask-token-id", str(_any_special_token_id(verifier_path))]
    if init is not None:  # a warm start: speculators takes every shape from the checkpoint and refuses shaping flags
        argv += ["--from-pretrained", str(init)]
    elif draft_config is not None:  # shapes from a reference draft (draft.like) instead of the verifier
        argv += ["--draft-config", str(draft_config)]  # speculators refuses the shaping flags beside it
    else:
        argv += ["--num-layers", "1", "--draft-arch", "llama", "--full-attention-indices", "0"]
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
    from eaglet.verifier import read_config_dict, text_config_of

    cfg = read_config_dict(Path(verifier_path))
    text = text_config_of(cfg)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = text.get(name, cfg.get(name))
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def check_init_dir(path: str | Path) -> None:
    """training.init given as a path: a speculators EAGLE-3 checkpoint (config + weights), checked before any load."""
    p = Path(path)
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise EagletError(f"training.init={path} is not a speculators checkpoint directory (config.json and "
                          "model.safetensors); use 'scratch', 'previous' or such a directory")


DELIVERED_FILE = "best_epoch.json"  # in a draft_ckpt artifact: which epoch is the draft, and what it predicts


def write_delivered(draft: Path, epoch_dir: Path, predicted: float | None) -> None:
    (draft / DELIVERED_FILE).write_text(json.dumps({"epoch": int(epoch_dir.name), "simulated": predicted}))


def read_delivered(draft: Path) -> dict | None:
    """{"epoch", "simulated"} of the epoch a stored draft was delivered from (None for drafts older than it)."""
    path = draft / DELIVERED_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def warm_start_weights(draft: Path) -> Path:
    """What a warm start loads: the float32 epoch checkpoint a stored draft was delivered from (older drafts: the
    last epoch) when it has one, else the directory itself (a delivered draft, bfloat16)."""
    epochs = draft / "checkpoints"
    if epochs.is_dir():
        with contextlib.suppress(RuntimeError):
            delivered = read_delivered(draft)
            chosen = epochs / str(delivered["epoch"]) if delivered else None
            return chosen if chosen and (chosen / "model.safetensors").is_file() else last_checkpoint(epochs)
    return draft


LINEAGE_FILE = "lineage.json"  # in a draft_ckpt artifact: every prompt the draft and its warm-start ancestors saw


def write_lineage(draft: Path, train_file: Path, init: Path | None) -> dict:
    """Record the prompts a draft trained on, with those of the draft it was warm-started from: what a later run
    checks against its held-out prompts. An ancestor without a record leaves the lineage unknown."""
    from eaglet.data import prompt_digests

    parent = read_lineage(init) if init else {"known": True, "prompts": [], "drafts": []}
    known = parent is not None and parent["known"]
    record = {"known": known, "drafts": ([init.name] + parent["drafts"]) if init and parent else [],
              "prompts": sorted(prompt_digests(train_file) | set(parent["prompts"] if parent else []))}
    (draft / LINEAGE_FILE).write_text(json.dumps(record))
    return record


def read_lineage(draft: Path) -> dict | None:
    """{"known", "drafts", "prompts"} of a draft eaglet trained (None: no record, e.g. a draft made elsewhere)."""
    path = draft / LINEAGE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def warm_start_decision(candidate: Path | None, held_out: set[str], explicit: bool) -> dict:
    """Whether training may start from `candidate`: never from a draft whose lineage trained on one of the run's
    held-out prompts (the run would then be measured on prompts its draft has seen). A draft with no lineage
    record is refused when found automatically ('previous'); a directory the user names is taken, its overlap
    reported as unknown."""
    n = len(held_out)
    if candidate is None:
        return {"from": None, "held_out_seen": None, "reason": "no earlier draft of this shape in the store: "
                "training from scratch"}
    lineage = read_lineage(candidate)
    if lineage is None or not lineage["known"]:
        if explicit:
            return {"from": str(candidate), "held_out_seen": None, "reason": f"warm start from {candidate}; it has "
                    "no eaglet lineage record, so whether it saw the held-out prompts is not known"}
        return {"from": None, "held_out_seen": None, "reason": f"refused the warm start from {candidate.name}: it "
                "records no complete lineage (trained before eaglet kept one), so it may have trained on held-out "
                "prompts; training from scratch"}
    seen = len(held_out & set(lineage["prompts"]))
    if seen:
        return {"from": None, "held_out_seen": seen, "reason": f"refused the warm start from {candidate.name}: it or "
                f"a draft it was warm-started from trained on {seen} of this run's {n} held-out prompts; training "
                "from scratch"}
    return {"from": str(candidate), "held_out_seen": 0, "reason": f"warm start from {candidate.name}; its lineage "
            f"({len(lineage['drafts']) + 1} drafts) trained on none of the {n} held-out prompts"}


def find_previous(drafts_dir: Path, shape: str, states: str) -> Path | None:
    """The most recent stored draft (`drafts_dir/<key>`, manifest inputs) of this shape trained on other data
    than `states`: a rerun over the same data finds the same draft again, so its training stays cached."""
    best, newest = None, -1.0
    for manifest in drafts_dir.glob("*/manifest.json") if drafts_dir.is_dir() else []:
        m = json.loads(manifest.read_text())
        inputs = m.get("inputs", {})
        if inputs.get("shape") == shape and inputs.get("states") != states and m["created"] > newest:
            best, newest = manifest.parent, m["created"]
    return best


CHECKPOINT_FILES = ("config.json", "model.safetensors", "optimizer_state_dict.pt", "scheduler_state_dict.pt")


def checkpoint_problem(epoch_dir: Path) -> str | None:
    """Why a speculators epoch checkpoint cannot be trusted (None if complete).

    speculators resumes from the highest-numbered epoch directory without checking it, so one cut short by a
    kill or a full disk would be loaded as if whole. safetensors: the header's data end must equal the file
    size; the torch .pt files are zip archives whose CRCs are checked.
    """
    import struct
    import zipfile

    for name in CHECKPOINT_FILES:
        if not (epoch_dir / name).is_file():
            return f"{name} is missing"
    st = epoch_dir / "model.safetensors"
    try:
        with open(st, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if st.stat().st_size != 8 + n + end:
            return "model.safetensors is truncated"
    except (struct.error, ValueError, KeyError):
        return "model.safetensors has no valid header"
    for name in ("optimizer_state_dict.pt", "scheduler_state_dict.pt"):
        try:
            with zipfile.ZipFile(epoch_dir / name) as z:
                if z.testzip() is not None:
                    return f"{name} is corrupt"
        except (zipfile.BadZipFile, OSError):
            return f"{name} is truncated"
    try:
        json.loads((epoch_dir / "config.json").read_text())
    except ValueError:
        return "config.json is not valid JSON"
    return None


def discard_incomplete_checkpoints(save_path: Path) -> list[str]:
    """Remove epoch checkpoints a killed run left incomplete, so speculators resumes from the last whole one."""
    removed = []
    if not save_path.is_dir():
        return removed
    for d in sorted(save_path.iterdir()):
        if d.is_dir() and not d.is_symlink() and d.name.isdigit():
            problem = checkpoint_problem(d)
            if problem:
                shutil.rmtree(d)
                removed.append(f"epoch {d.name}: {problem}")
    return removed


def last_checkpoint(save_path: Path) -> Path:
    """The newest complete epoch directory speculators wrote (config + weights)."""
    epochs = sorted(
        (p for p in save_path.iterdir() if p.is_dir() and p.name.isdigit()
         and (p / "config.json").is_file() and (p / "model.safetensors").is_file()),
        key=lambda p: int(p.name),
    )
    if not epochs:
        raise RuntimeError(f"speculators wrote no checkpoint under {save_path}")
    return epochs[-1]


def best_checkpoint(save_path: Path, metrics_file: Path) -> tuple[Path, float | None]:
    """The complete epoch checkpoint whose validation predicts the longest acceptance (simulated_acceptance), and
    that figure; the last epoch when no epoch was validated. speculators' own --save-best ranks by validation loss,
    which for a KL loss also rewards matching the verifier's low-probability tokens that acceptance never sees."""
    last = last_checkpoint(save_path)
    scored = {}
    for row in read_metrics(metrics_file):
        if row["kind"] == "val" and (save_path / str(row["epoch"]) / "model.safetensors").is_file():
            scored[row["epoch"]] = simulated_acceptance(row["metrics"])  # a resumed epoch: its last row wins
    scored = {e: a for e, a in scored.items() if a is not None and int(e) <= int(last.name)}
    if not scored:
        return last, None
    epoch = max(sorted(scored, reverse=True), key=lambda e: scored[e])  # ties: the later epoch
    return save_path / str(epoch), scored[epoch]


class MetricsRecorder(logging.Handler):
    """speculators logs its metrics as dicts on `speculators.metrics`: after every training step
    {"train": {loss_i, full_acc_i, cond_acc_i per TTT step i}, "epoch", "global_step", ...} and after every
    epoch {"val": {..._epoch}, "epoch"}. Each becomes one line of METRICS_FILE ({"kind", "epoch", "step",
    "metrics"}) and a call of on_metrics. It sits on the root logger because speculators' dictConfig replaces
    the handlers of its own loggers."""

    def __init__(self, path: Path, on_metrics: Callable[[dict], None] | None = None):
        super().__init__()
        self.file = open(path, "a")
        self.on_metrics = on_metrics

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if record.name != "speculators.metrics" or not isinstance(msg, Mapping) or getattr(record, "hparams", False):
            return
        kind = "train" if "train" in msg else "val" if "val" in msg else None
        if kind is None:
            return
        row = {"kind": kind, "epoch": msg.get("epoch"), "step": msg.get("global_step", getattr(record, "step", None)),
               "metrics": {k: float(v) for k, v in msg[kind].items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.on_metrics:
            self.on_metrics(row)

    def close(self) -> None:
        self.file.close()
        super().close()


METRICS_FILE = "metrics.jsonl"


def simulated_acceptance(val_metrics: Mapping[str, float]) -> float | None:
    """The position average: 1 + the sum over draft positions k of speculators' full_acc_k (the share of all
    response positions where steps 0..k were all right). It over-predicts vLLM; eaglet.acceptance says why and
    simulates decoding instead."""
    accs = [v for k, v in val_metrics.items() if k.startswith("full_acc_")]
    return 1.0 + sum(accs) if accs else None


def argv_values(argv: list[str], flag: str) -> list[str]:
    """The values after `flag` in a speculators argv (up to the next flag)."""
    i = argv.index(flag) + 1
    j = next((k for k in range(i, len(argv)) if argv[k].startswith("--")), len(argv))
    return argv[i:j]


def argv_value(argv: list[str], flag: str) -> str:
    return argv_values(argv, flag)[0]


def read_metrics(path: Path) -> list[dict]:
    f = path / METRICS_FILE if path.is_dir() else path
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []


def visible_accelerators() -> int:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES decides); 0 on CPU."""
    return torch.cuda.device_count() if on_accelerator() and torch.cuda.is_available() else 0


def torchrun_command(argv_file: Path, metrics_file: Path | None, nproc: int) -> list[str]:
    """One node, one rank per GPU, torchrun's standalone rendezvous; every rank runs eaglet.train_rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "eaglet.train_rank", str(argv_file)]
    return cmd + ([str(metrics_file)] if metrics_file else [])


def torchrun_argv(argv: list[str]) -> list[str]:
    """speculators shards the draft over the ranks only when asked (FSDP `fully_shard`)."""
    return argv if "--fsdp-shard" in argv else [*argv, "--fsdp-shard"]


def torchrun_env(nproc: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # torchrun's default is 1
    return env


def metrics_end(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def follow_metrics(path: Path, on_metrics: Callable[[dict], None], stop: threading.Event, offset: int = 0,
                   interval: float = 2.0) -> None:
    """Hand each row another process appends to `path` after byte `offset` to on_metrics, until `stop` is set
    (one last read after). Start at metrics_end() taken before launching: a resumed run's earlier rows were
    reported when they ran."""
    while True:
        finished = stop.wait(interval)
        if path.exists():
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next read
            offset += len(complete)
            for line in complete.decode().splitlines():
                if line.strip():
                    on_metrics(json.loads(line))
        if finished:
            return


def _train_with_torchrun(argv: list[str], metrics_file: Path | None, on_metrics, nproc: int) -> None:
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
        proc = subprocess.run(torchrun_command(argv_file, metrics_file, nproc), env=torchrun_env(nproc),
                              capture_output=True, text=True)
    finally:
        done.set()
        if follower:
            follower.join()
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun ({nproc} ranks) failed with exit {proc.returncode}:\n"
                           + (proc.stdout + proc.stderr)[-4000:])


def train_draft(argv: list[str], metrics_file: Path | None = None,
                on_metrics: Callable[[dict], None] | None = None, nproc: int | None = None) -> None:
    """Run speculators' training; its metrics are appended to metrics_file (a resumed run continues it).
    nproc: ranks (default: the visible GPUs). Above 1, torchrun launches them (speculators shards the draft with
    FSDP); otherwise speculators runs in this process. Either way a rerun resumes from the last epoch in
    --save-path."""
    nproc = visible_accelerators() if nproc is None else nproc
    if nproc > 1:
        return _train_with_torchrun(argv, metrics_file, on_metrics, nproc)
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(argv)
    recorder = MetricsRecorder(metrics_file, on_metrics) if metrics_file else None
    root = logging.getLogger()
    if recorder:
        root.addHandler(recorder)
    try:
        with lossless_checkpoints(), keep_log_handlers():
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
