"""The local Prefect stack teams run: server (embedded SQLite, or Postgres), the `eaglet-process` work pool, the
three deployments of prefect.yaml, and a worker. `eaglet stack up` starts it, `eaglet stack down` stops it.

Everything runs as child processes of nobody (own sessions), with pid and log files in
`$PREFECT_HOME/eaglet-stack/`, so `down` (or a test's teardown) can stop exactly what `up` started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eaglet.errors import EagletError
from eaglet.store import store_root

ROOT = Path(__file__).resolve().parent.parent
POOL = "eaglet-process"


def prefect_home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def stack_dir() -> Path:
    return prefect_home() / "eaglet-stack"


def prefect_defaults() -> dict[str, str]:
    """The Prefect settings every eaglet process starts with unless set otherwise (`eaglet run`, the stack)."""
    return {
        # Prefect 3.6.27-3.8.5 ignore PREFECT_HOME for results: caching needs an explicit result store, shared by
        # `eaglet run` and deployment runs.
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(store_root() / "prefect-results"),
        # eaglet's log lines reach the run's log in the UI; speculators prints its own (every step) to the console.
        "PREFECT_LOGGING_EXTRA_LOGGERS": "eaglet",
        "TOKENIZERS_PARALLELISM": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no network here; avoids telemetry errors
        # `eaglet run`'s temporary server migrates a fresh SQLite database before it answers; Prefect gives it 20 s,
        # which a busy 2-core machine exceeded (CI 2026-12-01: "Timed out while attempting to connect to ephemeral
        # Prefect API server" after 21 s, the test suite running beside it).
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    }


def stack_env(api_url: str) -> dict[str, str]:
    """What the server, the CLI calls and the worker (so every flow run it starts) see."""
    env = {**prefect_defaults(), **os.environ}
    env.update({
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(prefect_home()),
        "EAGLET_REPO": str(ROOT),  # prefect.yaml's pull step: flow runs start in this checkout
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    })
    return env


def _prefect(*args: str, env: dict, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise EagletError(f"`prefect {' '.join(args)}` failed: {(proc.stdout + proc.stderr).strip()[-2000:]}")
    return proc.stdout


def _spawn(name: str, args: list[str], env: dict) -> int:
    d = stack_dir()
    log = open(d / f"{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    (d / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of this process counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def _get_json(url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


def _wait(what: str, check, pid: int, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise EagletError(f"the {what} exited while starting; its log {log} ends with:\n"
                              + log.read_text(errors="replace")[-2000:])
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(1)
    raise EagletError(f"the {what} did not come up within {timeout:.0f} s; see {log}")


def status() -> dict:
    d = stack_dir()
    info = json.loads((d / "stack.json").read_text()) if (d / "stack.json").is_file() else {}
    for name in ("server", "worker"):
        pid_file = d / f"{name}.pid"
        pid = int(pid_file.read_text()) if pid_file.is_file() else None
        info[name] = {"pid": pid, "alive": bool(pid and _alive(pid))}
    return info


def up(port: int = 4200, deploy: bool = True, worker: bool = True) -> dict:
    """Start the server on 127.0.0.1:PORT, create the pool, deploy prefect.yaml, start a worker. Idempotent
    parts (pool, deployments) are re-applied; a stack that is already up is an error (run `down` first)."""
    current = status()
    if current["server"]["alive"] or current["worker"]["alive"]:
        raise EagletError(f"a stack is already running (pids in {stack_dir()}): `eaglet stack down` first")
    stack_dir().mkdir(parents=True, exist_ok=True)
    api_url = f"http://127.0.0.1:{port}/api"
    env = stack_env(api_url)
    d = stack_dir()

    # The database is $PREFECT_HOME/prefect.db (SQLite) unless PREFECT_SERVER_DATABASE_CONNECTION_URL says
    # postgresql+asyncpg://...; the server creates and migrates it on start.
    pid = _spawn("server", ["server", "start", "--host", "127.0.0.1", "--port", str(port)], env)
    _wait("Prefect server", lambda: _get_json(f"{api_url}/health") is True, pid, 180, d / "server.log")

    _prefect("work-pool", "create", POOL, "--type", "process", "--overwrite", env=env)
    if deploy:
        _prefect("--no-prompt", "deploy", "--all", env=env, timeout=600)
    if worker:
        wpid = _spawn("worker", ["worker", "start", "--pool", POOL, "--type", "process"], env)
        _wait("worker", lambda: len(_get_json(f"{api_url}/work_pools/{POOL}/workers/filter", {})) > 0,
              wpid, 120, d / "worker.log")
    info = {"api_url": api_url, "ui_url": f"http://127.0.0.1:{port}", "pool": POOL,
            "database": env.get("PREFECT_SERVER_DATABASE_CONNECTION_URL") or str(prefect_home() / "prefect.db"),
            "results": env["PREFECT_RESULTS_LOCAL_STORAGE_PATH"]}
    (d / "stack.json").write_text(json.dumps(info, indent=2))
    (d / "env.sh").write_text(f"export PREFECT_API_URL={api_url}\n"
                              f"export PREFECT_RESULTS_LOCAL_STORAGE_PATH={info['results']}\n")
    return info


def down(timeout: float = 30) -> list[str]:
    """Stop the worker (it cancels nothing: flow runs it started finish or die with it), then the server."""
    stopped = []
    for name in ("worker", "server"):
        pid_file = stack_dir() / f"{name}.pid"
        if not pid_file.is_file():
            continue
        pid = int(pid_file.read_text())
        if _alive(pid):
            try:
                os.killpg(pid, signal.SIGTERM)  # its own session: the server's uvicorn children go too
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + timeout
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.5)
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)
            stopped.append(f"{name} (pid {pid})")
        pid_file.unlink()
    (stack_dir() / "stack.json").unlink(missing_ok=True)
    return stopped
