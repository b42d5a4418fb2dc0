"""speculators' training metrics: recorded to METRICS_FILE as they are logged, read back, followed across processes."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path


METRICS_FILE = "metrics.jsonl"


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


def read_metrics(path: Path) -> list[dict]:
    f = path / METRICS_FILE if path.is_dir() else path
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []


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


def training_monitor(log, progress: Callable[..., None], epochs: int,
                     score: Callable[[Mapping[str, float]], float | None]) -> Callable[[dict], None]:
    """on_metrics for train_draft: speculators' metrics into the run log (every 10th logged step, every epoch's
    validation) and progress(done, total, note=...) in epochs. speculators logs every 10th step and says nothing of
    an epoch's length, so progress within an epoch is known from the second epoch on (the first one's last step).
    score: the architecture's predicted acceptance from validation metrics (DraftArchitecture.score). Epochs are
    counted from 1 in the log as in the progress (speculators counts from 0)."""
    last_step: dict[int, int] = {}  # epoch -> the last global step seen in it
    rows = 0

    def short(metrics: dict) -> str:
        return ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith(("loss", "full_acc", "eal")))

    def on_metrics(row: dict) -> None:
        nonlocal rows
        epoch = row["epoch"] or 0
        if row["kind"] == "val":
            predicted = score(row["metrics"])
            log.info(f"epoch {epoch + 1} of {epochs} validation: {short(row['metrics'])}"
                     + (f"; predicted acceptance length {predicted:.3f}" if predicted else ""))
            progress(epoch + 1, epochs, note=f"{epoch + 1} of {epochs} epochs done")
            last_step[epoch] = row["step"] or last_step.get(epoch, 0)  # the epoch's last step
            return
        rows += 1
        if rows % 10 == 1:
            log.info(f"epoch {epoch + 1} of {epochs}, step {row['step']}: {short(row['metrics'])}")
        step, before = row["step"] or 0, last_step.get(epoch - 1, 0)
        last_step[epoch] = step
        if epoch - 1 in last_step:
            per_epoch = last_step[epoch - 1] - last_step.get(epoch - 2, 0)
            n = step - before
            progress(epoch + min(n / per_epoch, 0.99), epochs,
                     note=f"epoch {epoch + 1} of {epochs}, step {n} of about {per_epoch}")
    return on_metrics
