"""speculators on a CPU: the smallest patches of its accelerator assumptions, each naming the upstream behaviour."""

from __future__ import annotations

import contextlib

import torch
from eaglet.train.ttt_attention import chunked_ttt_attention


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
      "cpu" it autocasts to --hidden-states-dtype (faster in bf16 where `cpu_dtype` chooses it).
    Not a fix but a CPU speed-up: the draft's attention skips the keys its packed TTT mask excludes
    (eaglet.train.ttt_attention).
    """
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
