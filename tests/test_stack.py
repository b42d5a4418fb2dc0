"""The way teams run it: a real Prefect server (embedded SQLite) and worker brought up by `eaglet stack up`,
prefect.yaml deployed, `prefect deployment run train-eagle3/ci --watch` twice on the tiny verifier, the run's
artifacts read back through the API, the `manual` deployment's form opened in headless Chromium, and the
stack torn down."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

# The ci deployment's parameters, scaled to the tiny verifier: every stage runs, two vLLM loads included.
CI_PARAMS = {
    "verifier": {"path": None},
    "data": {"max_samples": 64, "max_seq_len": 256, "max_new_tokens": 32},  # the ci deployment's 64 rows
    "draft": {"draft_vocab_size": 256},
    "training": {"epochs": 2, "total_seq_len": 1024},
    "smoke": {"num_prompts": 4, "max_tokens": 32},
    "eval": {"enabled": False},  # the serving evaluation's own tests: tests/test_serving_e2e.py
}
SECTIONS = ("Verifier", "Data", "Extraction", "Draft", "Training", "Export", "Smoke", "Eval")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"},
                                 method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("stack")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({
        "PREFECT_HOME": str(home / "prefect"),
        "EAGLET_HOME": str(home / "store"),
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "prefect-results"),
        "PREFECT_WORKER_QUERY_SECONDS": "2",  # the worker polls every 10 s by default
    })
    port = _free_port()
    cli = [sys.executable, "-m", "deployments.cli", "stack"]
    up = subprocess.run([*cli, "up", "--port", str(port)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
    info = {"env": env, "home": home, "api": f"http://127.0.0.1:{port}/api", "ui": f"http://127.0.0.1:{port}",
            "up": up}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        env["PREFECT_API_URL"] = info["api"]
        yield info
    finally:
        status = json.loads(subprocess.run([*cli, "status"], cwd=ROOT, env=env, capture_output=True,
                                           text=True).stdout)
        down = subprocess.run([*cli, "down"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr
        for name in ("server", "worker"):
            pid = status[name]["pid"]
            assert pid and not Path(f"/proc/{pid}").exists(), f"{name} (pid {pid}) still running after down"
        with pytest.raises(OSError):  # nothing listens any more
            urllib.request.urlopen(info["api"] + "/health", timeout=5)


def _deployment_run(stack, params: dict, out: Path) -> tuple[subprocess.CompletedProcess, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", "deployment", "run", "train-eagle3/ci", "--watch",
         "--watch-interval", "2", "--watch-timeout", "1500",
         "--param", f"params={json.dumps(params)}", "--param", f"output_dir={out}"],
        cwd=ROOT, env=stack["env"], capture_output=True, text=True, timeout=1800)
    m = re.search(r"UUID: ([0-9a-f-]{36})", proc.stdout)
    return proc, m.group(1) if m else ""


def _task_states(stack, flow_run_id: str) -> dict[str, str]:
    runs = _api(stack["api"], "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    return {r["name"].rsplit("-", 1)[0]: r["state"]["name"] for r in runs}  # "train-draft-4df" -> "train-draft"


def _artifacts(stack, flow_run_id: str) -> dict[str, dict]:
    arts = _api(stack["api"], "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    return {a["key"]: a for a in arts}


def test_ci_deployment_runs_on_the_worker_and_reruns_from_cache(stack, tiny_verifier, tmp_path):
    deployments = {d["name"]: d for d in _api(stack["api"], "/deployments/filter", {})}
    assert set(deployments) == {"manual", "nightly-retrain", "ci"}
    nightly = deployments["nightly-retrain"]
    assert [s["schedule"]["cron"] for s in nightly["schedules"]] == ["0 2 * * *"]
    assert nightly["global_concurrency_limit"]["limit"] == 1

    # The server checks parameters against RunConfig's schema before a run exists.
    bad = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "train-eagle3/ci",
                          "--param", 'params={"training": {"epochs": 0}}'],
                         cwd=ROOT, env=stack["env"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "epochs" in bad.stdout + bad.stderr, bad.stdout + bad.stderr
    assert _api(stack["api"], "/flow_runs/filter", {}) == []

    params = json.loads(json.dumps(CI_PARAMS))
    params["verifier"]["path"] = str(tiny_verifier)
    first, first_id = _deployment_run(stack, params, tmp_path / "run1")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert "Completed" in first.stdout

    states = _task_states(stack, first_id)
    assert {states[t] for t in ("plan-capture", "load-verifier", "generate-and-capture", "train-draft", "smoke-test",
                                "report-and-promote")} == {"Completed"}  # the report, gate and promotion: a task
    arts = _artifacts(stack, first_id)
    assert {"eaglet-report", "acceptance-per-position", "flat-draft", "plot-training", "plot-acceptance",
            "capture", "training"} <= set(arts)
    for key in ("capture", "training"):
        assert arts[key]["type"] == "progress" and arts[key]["data"] == 100.0, arts[key]
    report = arts["eaglet-report"]["data"]
    assert "## vLLM smoke test" in report and "data:image/png;base64," in report
    assert "`transformer_layer_config.bos_token_id`" in report or "moved unchanged" in report
    table = json.loads(arts["acceptance-per-position"]["data"])
    assert [row["position"] for row in table] == [1, 2, 3]
    assert str(tmp_path / "run1" / "draft") in arts["flat-draft"]["data"]
    assert (tmp_path / "run1" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    second, second_id = _deployment_run(stack, params, tmp_path / "run2")
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    states = _task_states(stack, second_id)
    heavy = ("prepare-data", "generate-and-capture", "build-vocab", "train-draft", "export-draft", "smoke-test")
    assert {t: states[t] for t in heavy} == {t: "Cached" for t in heavy}
    assert "eaglet-report" in _artifacts(stack, second_id)
    report2 = json.loads((tmp_path / "run2" / "report.json").read_text())
    assert report2["verifier_loads"] == 0 and "load-verifier" not in states

    # The quality gate: a bar above what the draft reaches (k=3: at most 4) fails the CI job, from cache.
    strict = json.loads(json.dumps(params))
    strict["smoke"]["min_acceptance"] = 4.5
    third, third_id = _deployment_run(stack, strict, tmp_path / "run2")
    assert third.returncode != 0, third.stdout[-3000:]
    assert _task_states(stack, third_id)["smoke-test"] == "Cached"
    report3 = json.loads((tmp_path / "run2" / "report.json").read_text())
    assert "below smoke.min_acceptance=4.5" in report3["gate_failure"]
    history = json.loads(_artifacts(stack, third_id)["draft-history"]["data"])
    assert len(history) == 1 and history[0]["current"] == "yes"  # the same draft, promoted by run2 itself


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_manual_deployment_form_in_headless_chromium(stack, tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: scripts/setup.sh installs Debian's chromium")
        pytest.skip("chromium not installed (scripts/setup.sh installs it)")
    manual = _api(stack["api"], "/deployments/filter", {"deployments": {"name": {"any_": ["manual"]}}})[0]
    url = f"{stack['ui']}/deployments/deployment/{manual['id']}/run"
    flags = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--hide-scrollbars", "--window-size=1400,2200", "--virtual-time-budget=20000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    text = re.sub(r"<[^>]+>", " ", dom)
    missing = [s for s in SECTIONS if f"{s} (Optional)" not in text]
    assert not missing, f"parameter sections missing from the run form: {missing}"
    from eaglet.config import RunConfig

    for section in ("draft", "training"):  # every field's description is on the form
        for field in getattr(RunConfig.model_fields[section].annotation, "model_fields").values():
            assert field.description.split(" (")[0][:40] in text, field.description
    shot = tmp_path / "manual-run-form.png"
    subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, timeout=180)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("EAGLET_UPDATE_DOCS"):
        shutil.copy(shot, ROOT / "docs" / "manual-run-form.png")


@pytest.mark.parametrize("pool,kind,template", [("eaglet-gpu", "process", "process-gpu.json"),
                                                ("eaglet-k8s", "kubernetes", "kubernetes-gpu.json")])
def test_gpu_work_pool_templates_are_accepted_by_the_server(stack, pool, kind, template):
    path = ROOT / "deployments" / "work-pools" / template
    proc = subprocess.run([sys.executable, "-m", "prefect", "work-pool", "create", pool, "--type", kind,
                           "--base-job-template", str(path)], cwd=ROOT, env=stack["env"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    created = _api(stack["api"], f"/work_pools/{pool}")
    assert created["type"] == kind and created["base_job_template"] == json.loads(path.read_text())
