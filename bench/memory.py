"""Resident memory of a process tree, sampled in a thread (vLLM and Prefect put work in child processes)."""

from __future__ import annotations

import threading
import time

import psutil


class TreeRSS:
    """Samples the summed RSS of `pid` and all its descendants every `interval` seconds: (time, bytes)."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree_rss(self) -> int:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._tree_rss()))
            self._stop.wait(self.interval)

    def __enter__(self) -> "TreeRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start: float | None = None, end: float | None = None) -> int | None:
        window = [b for t, b in self.samples if (start is None or t >= start) and (end is None or t <= end)]
        return max(window) if window else None
