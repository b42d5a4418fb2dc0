"""Which devices this process computes on: training, capture and the engines ask the same question."""

from __future__ import annotations


def on_accelerator() -> bool:
    import torch  # heavy: only when a device is asked about

    return torch.accelerator.current_accelerator(check_available=True) is not None


def visible_accelerators() -> int:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES decides); 0 on CPU."""
    import torch  # heavy: only when a device is asked about

    return torch.cuda.device_count() if on_accelerator() and torch.cuda.is_available() else 0
