"""The one way eaglet stops a vLLM process: its whole process group, politely first."""

from __future__ import annotations

import os
import signal
import time


def _gone(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return True  # our child, reaped
    except ChildProcessError:  # not our child (or already reaped): does it still exist?
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
    return False


def stop_group(pid: int, grace: float = 30.0) -> None:
    """Stop process group `pid` (a child started with start_new_session): SIGTERM lets vLLM shut down its engine
    core and workers, which would otherwise keep the model's memory; SIGKILL whatever is left after `grace` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if _gone(pid):
                return
            time.sleep(0.2)
