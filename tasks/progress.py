"""Progress of a long step, where the person watching is: a progress artifact in the Prefect UI, a tqdm bar when
the run is attached to a terminal, and otherwise a plain log line about every 10%."""

from __future__ import annotations

import sys
import time

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact

UPDATE_EVERY = 5.0


class Progress:
    def __init__(self, key: str, description: str, unit: str):
        self.unit = unit
        self.description = description
        self.log = get_run_logger()
        self.artifact_id = create_progress_artifact(0.0, key=key, description=description)
        self.bar = None
        self.last_logged = -1
        self.last_update = time.monotonic()
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=description, unit=unit, file=sys.stderr, leave=False)

    def __call__(self, done: float, total: float, rate: float | None = None, note: str = "") -> None:
        percent = 100.0 * done / total if total else 100.0
        now = time.monotonic()
        # An update is an API call: at most one every UPDATE_EVERY seconds, and always the last.
        if percent >= 100.0 or now - self.last_update >= UPDATE_EVERY:
            update_progress_artifact(self.artifact_id, min(100.0, percent))
            self.last_update = now
        rate_text = f", {rate:.0f} tokens/s" if rate else ""
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.set_postfix_str((note + rate_text).strip(", "), refresh=False)
            self.bar.refresh()
            return
        tenth = int(percent // 10)
        if tenth > self.last_logged:
            self.last_logged = tenth
            where = note or f"{done:g}/{total:g} {self.unit}"  # a note says it in whole units (epoch 2 of 4, ...)
            self.log.info(f"{self.description}: {where} ({percent:.0f}%){rate_text}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def with_progress(key: str, description: str, unit: str, work):
    """work(progress) with a progress artifact and bar that close when it ends."""
    progress = Progress(key, description, unit)
    try:
        return work(progress)
    finally:
        progress.close()
