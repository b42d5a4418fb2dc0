"""Shared fixtures: one tiny verifier and one end-to-end flow run per session.

Every test gets its own artifact store and Prefect home, so nothing from a developer's machine leaks in.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.stack import prefect_defaults
from eaglet.verifier.tiny import make_tiny_verifier

# Prefect's temporary API server logs "Stopping ..." at interpreter exit, after pytest closed its streams.
logging.raiseExceptions = False

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "data" / "prompts.jsonl"

# Flows also run in this process (test_bad_input), starting Prefect's temporary server here: give it the time
# `eaglet run` gives it (CI 2026-12-02 timed out at Prefect's own 20 s on the busy 2 cores). Set before any test
# module imports prefect, which reads its settings once, at import.
STARTUP_TIMEOUT = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
os.environ.setdefault(STARTUP_TIMEOUT, prefect_defaults()[STARTUP_TIMEOUT])

# Small but real: the whole flow, speculators training and two vLLM loads, in a few minutes on 2 cores.
TINY_RUN = [
    "draft.draft_vocab_size=256",
    "data.max_seq_len=256",
    "data.max_new_tokens=40",  # shorter than smoke.max_tokens: the capture engine must still fit the baseline
    "training.epochs=2",
    "training.total_seq_len=1024",
    "smoke.num_prompts=16",
    "smoke.max_tokens=48",
    "eval.enabled=false",  # the serving evaluation runs in the tests of tests/test_serving_e2e.py only
]


HEAVY_FIXTURES = {"e2e_run", "engine", "one_pass", "dflash_run", "nightly", "tiny_kimi"}  # engines and flow runs


def pytest_collection_modifyitems(items):
    """A test that uses an engine or a flow run must be marked e2e, so `make test-fast` never starts one."""
    unmarked = [i.nodeid for i in items if HEAVY_FIXTURES & set(getattr(i, "fixturenames", ()))
                and not i.get_closest_marker("e2e")]
    if unmarked:
        raise pytest.UsageError(f"mark these e2e (they start an engine or run the flow): {', '.join(unmarked)}")


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eaglet")


@pytest.fixture(scope="session", autouse=True)
def isolated_env(session_dir):
    """Point eaglet and Prefect at this session's directories (result storage must be set explicitly)."""
    env = {
        "EAGLET_HOME": str(session_dir / "store"),
        "PREFECT_HOME": str(session_dir / "prefect"),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(session_dir / "prefect-results"),
        "PREFECT_API_URL": "",
        "TOKENIZERS_PARALLELISM": "false",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.environ.pop("PREFECT_API_URL")
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_verifier(session_dir) -> Path:
    return make_tiny_verifier(session_dir / "tiny-verifier", PROMPTS)


def run_cli(args: list[str], env_extra: dict | None = None, timeout: int = 1500) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "deployments.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def e2e_run(session_dir, tiny_verifier) -> dict:
    """One real run of the flow on the tiny verifier, in its own process; shared by the end-to-end tests."""
    out = session_dir / "run1"
    sets = [f"--set={s}" for s in TINY_RUN + [f"verifier.path={tiny_verifier}"]]
    proc = run_cli(["run", *sets, "--output-dir", str(out)])
    log = session_dir / "run1.log"  # kept for the tests' failure messages (a retried task shows only here)
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"out": out, "report": json.loads((out / "report.json").read_text()), "sets": sets, "log": log}
