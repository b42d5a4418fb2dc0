"""Never pay twice: kill -9 mid-extraction and mid-training, concurrent identical runs, and cache records whose
artifact is gone. Every run is a separate `eaglet run` process with its own temporary Prefect server."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglet import store
from eaglet.train.checkpoints import checkpoint_problem, discard_incomplete_checkpoints
from tests.conftest import PROMPTS, ROOT, run_cli

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def answered(tmp_path_factory) -> Path:
    """Conversations with answers (no regeneration: these tests are about extraction and training)."""
    out = tmp_path_factory.mktemp("resume") / "conversations.jsonl"
    with out.open("w") as f:
        for line in PROMPTS.read_text().splitlines()[:300]:
            prompt = json.loads(line)["prompt"]
            answer = " ".join(reversed(prompt.lower().split())) * 3
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return out


def _sets(verifier, data, epochs=2):
    # The hf backend: these tests are about the store and the flow's resume (the vllm pass's kill -9 and resume:
    # tests/test_capture_vllm.py).
    return [f"--set=verifier.path={verifier}", f"--set=data.path={data}", "--set=data.regenerate=false",
            "--set=extraction.backend=hf",
            "--set=smoke.enabled=false", "--set=data.eval_fraction=0.25", "--set=data.max_seq_len=256",
            "--set=draft.draft_vocab_size=256", "--set=extraction.batch_size=1", f"--set=training.epochs={epochs}"]


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(EAGLET_HOME=str(home / "store"), PREFECT_HOME=str(home / "prefect"),
               PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results"))
    return env


def _start(args, home: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deployments.cli", *args], cwd=ROOT, env=_env(home),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill_when(proc: subprocess.Popen, condition, timeout=300) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, "the run ended before it could be killed:\n" + proc.stdout.read()[-3000:]
        assert time.time() < deadline, "timed out waiting for the moment to kill"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its Prefect server: no cleanup code runs
    proc.wait()


def _run(args, home: Path) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", *args], cwd=ROOT, env=_env(home),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads((Path(args[args.index("--output-dir") + 1]) / "report.json").read_text())


def test_kill_9_mid_extraction_and_mid_training_then_resume(tiny_verifier, answered, tmp_path):
    home = tmp_path / "killed"
    args = [*_sets(tiny_verifier, answered, epochs=3), "--output-dir", str(tmp_path / "out")]
    shards = lambda: list((home / "store" / "hidden_states").glob(".partial-*/hidden_states/.shards/*.json"))  # noqa: E731

    run = _start(["run", *args], home)
    _kill_when(run, lambda: len(shards()) >= 20)
    done_at_kill = len(shards())
    assert not store.list_artifacts(home / "store") or all(
        a["kind"] != "hidden_states" for a in store.list_artifacts(home / "store"))

    def first_epoch_saved():
        ckpts = list((home / "store" / "draft_ckpt").glob(".partial-*/checkpoints/0"))
        return bool(ckpts) and checkpoint_problem(ckpts[0]) is None

    run = _start(["run", *args], home)
    _kill_when(run, first_epoch_saved)
    partial_ckpt = next((home / "store" / "draft_ckpt").glob(".partial-*/checkpoints"))
    epochs_at_kill = sorted(d.name for d in partial_ckpt.iterdir() if d.name.isdigit())

    proc, report = _run(["run", *args], home)
    stats = json.loads((Path(report["artifacts"]["hidden_states"]) / "stats.json").read_text())
    # the second attempt kept every shard finished before the kill and recomputed only the rest
    assert stats["resumed_shards"] == done_at_kill and 0 < done_at_kill < stats["shards"]
    assert report["tasks"]["extract-hidden-states"]["state"] == "Cached"  # the third attempt
    out = proc.stdout + proc.stderr
    assert "Found checkpoint at" in out and f"checkpoints/{epochs_at_kill[-1]}" in out, epochs_at_kill

    # the same artifacts as a run never interrupted (separate store, same inputs)
    _, clean = _run(["run", *_sets(tiny_verifier, answered, epochs=3), "--output-dir", str(tmp_path / "clean")],
                    tmp_path / "clean-home")
    assert store.artifact_digest(report["artifacts"]["hidden_states"]) == store.artifact_digest(
        clean["artifacts"]["hidden_states"])
    for name in ("model.safetensors", "config.json"):  # the trained draft, bit for bit
        assert (Path(report["artifacts"]["checkpoint"]) / name).read_bytes() == (
            Path(clean["artifacts"]["checkpoint"]) / name).read_bytes(), name
    assert (Path(report["draft_dir"]) / "model.safetensors").read_bytes() == (
        Path(clean["draft_dir"]) / "model.safetensors").read_bytes()


def test_concurrent_identical_runs_extract_once(tiny_verifier, answered, tmp_path):
    home = tmp_path / "shared"
    a = _start(["run", *_sets(tiny_verifier, answered), "--output-dir", str(tmp_path / "a")], home)
    b = _start(["run", *_sets(tiny_verifier, answered), "--output-dir", str(tmp_path / "b")], home)
    out_a, out_b = a.communicate(timeout=900)[0], b.communicate(timeout=900)[0]
    assert a.returncode == 0 and b.returncode == 0, out_a[-2000:] + out_b[-2000:]
    ra = json.loads((tmp_path / "a" / "report.json").read_text())
    rb = json.loads((tmp_path / "b" / "report.json").read_text())
    assert ra["artifacts"]["hidden_states"] == rb["artifacts"]["hidden_states"]
    assert ra["verifier_loads"] + rb["verifier_loads"] == 1  # one extraction; the other run waited and reused it
    assert [p.name for p in (home / "store" / "hidden_states").iterdir()] == [
        Path(ra["artifacts"]["hidden_states"]).name]  # one artifact, no partial or duplicate build left over


def test_incomplete_checkpoints_are_discarded(e2e_run, tmp_path):
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(Path(e2e_run["report"]["artifacts"]["checkpoint"]) / "checkpoints", ckpts, symlinks=True)
    epochs = sorted(int(d.name) for d in ckpts.iterdir() if d.name.isdigit())
    assert len(epochs) >= 2 and all(checkpoint_problem(ckpts / str(e)) is None for e in epochs)
    last, before = ckpts / str(epochs[-1]), ckpts / str(epochs[-2])
    with open(last / "model.safetensors", "r+b") as f:  # cut short, as by a kill during the save
        f.truncate(f.seek(0, 2) // 2)
    with open(before / "optimizer_state_dict.pt", "r+b") as f:
        f.truncate(100)
    removed = discard_incomplete_checkpoints(ckpts)
    assert removed == [f"epoch {epochs[-2]}: optimizer_state_dict.pt is truncated",
                       f"epoch {epochs[-1]}: model.safetensors is truncated"]
    assert sorted(int(d.name) for d in ckpts.iterdir() if d.name.isdigit()) == epochs[:-2]


def test_deleted_artifact_is_rebuilt_not_trusted_from_the_cache(e2e_run, session_dir):
    vocab = Path(e2e_run["report"]["artifacts"]["vocab"])
    shutil.rmtree(vocab)  # e.g. removed by hand; Prefect still holds a cached result pointing at it
    out = session_dir / "run-after-delete"
    proc = run_cli(["run", *e2e_run["sets"], "--set=smoke.enabled=false", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "report.json").read_text())
    assert r["tasks"]["build-vocab"]["state"] == "Completed" and store.is_published(vocab)
    assert r["tasks"]["generate-and-capture"]["state"] == "Cached" and r["verifier_loads"] == 0
    assert "load-verifier" not in r["tasks"]  # nothing to capture: no engine started
