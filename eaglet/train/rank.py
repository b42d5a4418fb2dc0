"""One rank of a multi-GPU training run: `torchrun --nproc-per-node N -m eaglet.train.rank ARGV.json METRICS`.

speculators sets itself up from torchrun's environment (LOCAL_RANK: process group on the accelerator's default
backend, FSDP `fully_shard` of the draft, a distributed sampler); each rank runs the same speculators `main`
with the same eaglet adjustments as a single-process run (float32 epoch checkpoints, no handler clearing).
Rank 0 records the metrics (speculators logs them on rank 0 only)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from eaglet.train.launch import STREAM_ENV, train_draft

if __name__ == "__main__":
    argv = json.loads(Path(sys.argv[1]).read_text())
    metrics = Path(sys.argv[2]) if len(sys.argv) > 2 and os.environ.get("RANK", "0") == "0" else None
    stream = json.loads(os.environ[STREAM_ENV]) if os.environ.get(STREAM_ENV) else None
    train_draft(argv, metrics, nproc=1, stream=stream)  # nproc=1: this process is one rank, never a launcher
