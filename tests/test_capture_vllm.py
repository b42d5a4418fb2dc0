"""The vllm capture backend, run for real on vLLM's CPU backend: one engine generates and captures; its states
against a prefill of the same ids and against the hf backend; a kill -9 mid-pass and the resume; engines kept
up with `eaglet verifier serve`, used by a run that then loads nothing; two engines in one run, one killed
mid-pass (eaglet.capture.fleet); the checks made before any load."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from eaglet.capture.engine import capture_layers, free_port, start_engine, stop_engine
from eaglet.capture.hf import extract_hidden_states
from eaglet.capture.vllm import _complete, _load, generate_and_capture
from eaglet.errors import EagletError
from eaglet.store import file_sha256
from eaglet.verifier.devices import visible_accelerators
from eaglet.verifier import resolve_verifier
from tests.conversations import write_echo_conversations
from tests.conftest import ROOT, TINY_RUN, run_cli

pytestmark = pytest.mark.e2e  # vLLM engines and `eaglet run`: the pure capture checks are in test_capture_plan.py

AUX = [2, 4, 5]
LAYERS = capture_layers(AUX, 8)  # the tiny verifier's 8 layers: vLLM ids [2, 4, 5, 8]
MAX_SEQ, NEW = 128, 32


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return write_echo_conversations(tmp_path_factory.mktemp("vx") / "c.jsonl", 24)


@pytest.fixture(scope="module")
def engine(tiny_verifier, tmp_path_factory):
    info = resolve_verifier(tiny_verifier, AUX)
    eng = start_engine(info.path, info.fingerprint, capture_layers(AUX, info.num_layers),
                       tmp_path_factory.mktemp("engine"), MAX_SEQ + NEW)
    yield eng
    stop_engine(eng)


def _pass(engine, verifier, conversations, out: Path, **kw) -> dict:
    out.mkdir(exist_ok=True)
    return generate_and_capture(engine, str(verifier), conversations, out, LAYERS, MAX_SEQ,
                                max_new_tokens=NEW, **kw)


def _files(path) -> dict[str, str]:
    return {str(f.relative_to(path)): file_sha256(f) for f in sorted(path.rglob("*")) if f.is_file()}


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Worst per-token cosine and worst per-token relative error between two [T, layers, H] states."""
    a, b = a.float(), b.float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
    rel = ((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item()
    return cos, rel


@pytest.fixture(scope="module")
def one_pass(engine, tiny_verifier, conversations, tmp_path_factory):
    out = tmp_path_factory.mktemp("pass") / "gen"
    return out, _pass(engine, tiny_verifier, conversations, out)


def test_one_pass_states_equal_a_prefill_of_the_same_ids(one_pass, engine):
    """The states saved while generating are the ones a prefill of the same token ids gives (bf16 rounding)."""
    out, stats = one_pass
    assert stats["mode"] == "generate+capture" and stats["samples"] == 24 and stats["generated_tokens"] > 0
    worst_cos, worst_rel = 1.0, 0.0
    with httpx.Client(timeout=600) as client:
        for i in range(stats["samples"]):
            saved = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
            ids = saved["token_ids"].tolist()
            prefill = _load(_complete(client, engine, {"prompt_ids": ids}, None)["path"])
            assert prefill["token_ids"].tolist() == ids
            cos, rel = _compare(prefill["hidden_states"], saved["hidden_states"])
            worst_cos, worst_rel = min(worst_cos, cos), max(worst_rel, rel)
    print(f"one pass vs prefill: worst per-token cosine {worst_cos:.6f}, worst relative error {worst_rel:.4f}")
    assert worst_cos > 0.9995 and worst_rel < 0.02, (worst_cos, worst_rel)


def test_one_pass_writes_speculators_dataset_and_the_answers(one_pass, tiny_verifier):
    from datasets import load_from_disk

    out, stats = one_pass
    ds = load_from_disk(str(out))
    answers = [json.loads(line)["messages"] for line in (out / "responses.jsonl").read_text().splitlines()]
    assert len(ds) == len(answers) == stats["samples"]
    for i in range(len(ds)):
        f = load_file(out / "hidden_states" / f"hs_{i}.safetensors")
        ids, mask = ds[i]["input_ids"].tolist(), ds[i]["loss_mask"].tolist()
        assert f["token_ids"].tolist() == ids and f["hidden_states"].shape == (len(ids), len(AUX) + 1, 128)
        n_prompt = mask.index(1) if 1 in mask else len(mask)
        assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)  # the loss is on the verifier's answer only
        assert answers[i][-1]["role"] == "assistant"
    assert not list(out.rglob(".shards"))  # records dropped once the artifact is whole


def _strip(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


@pytest.mark.skipif(visible_accelerators() > 0, reason="the capture scheduler is the CPU path")
def test_capture_engine_samples_as_a_plain_engine(engine, tiny_verifier, conversations, tmp_path):
    """Sampled answers (temperature 0.8, a seed per request) from the capture engine are token for token those of
    a plain vLLM server with the same settings and no capture method. Before eaglet.capture.scheduler, vLLM's
    capture engine on CPU sampled unrelated tokens (its placeholder draft went through the rejection sampler)."""
    from eaglet.capture.engine import healthy, server_argv
    from eaglet.capture.vllm import chat_prompt_ids
    from eaglet.data import prompt_part, read_conversations
    from eaglet.vllm import vllm_env
    from transformers import AutoTokenizer

    assert "eaglet.capture.scheduler.CaptureScheduler" in server_argv("v", "n", [1], tmp_path, 64, "h", 1)
    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    prompts = [chat_prompt_ids(tok, prompt_part(m)) for m in read_conversations(conversations)[:8]]
    port = free_port()
    argv = _strip(server_argv(str(tiny_verifier), "plain", [1], tmp_path, MAX_SEQ + NEW, "127.0.0.1", port),
                  ("--speculative-config", "--kv-transfer-config", "--scheduler-cls", "--served-model-name"))
    with open(tmp_path / "plain.log", "w") as log:  # the child keeps its own copy of the descriptor
        plain = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True)
    try:
        deadline = time.time() + 600
        while not healthy(f"http://127.0.0.1:{port}"):
            assert plain.poll() is None and time.time() < deadline, (tmp_path / "plain.log").read_text()[-3000:]
            time.sleep(0.5)
        answers = {"capture": [], "plain": []}
        with httpx.Client(timeout=600) as client:
            for i, ids in enumerate(prompts):
                body = {"prompt": ids, "max_tokens": NEW, "temperature": 0.8, "seed": 100 + i}
                r = client.post(f"{engine.endpoint}/v1/completions", json=dict(body, model=engine.served_name))
                answers["capture"].append(r.json()["choices"][0]["text"])
                r = client.post(f"http://127.0.0.1:{port}/v1/completions", json=dict(body, model=str(tiny_verifier)))
                answers["plain"].append(r.json()["choices"][0]["text"])
        assert answers["capture"] == answers["plain"]
        assert len(set(answers["plain"])) > 1  # sampled, not one answer repeated
    finally:
        os.killpg(plain.pid, signal.SIGTERM)
        try:
            plain.wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(plain.pid, signal.SIGKILL)


def test_prefill_pass_matches_the_hf_backend(engine, tiny_verifier, conversations, tmp_path):
    """data.regenerate=false: the same engine, prefill-only, over the given conversations = the hf backend's
    artifact: same dataset bytes, token counts and file set; states equal to bf16 rounding."""
    hf = extract_hidden_states(str(tiny_verifier), conversations, _mk(tmp_path / "hf"), AUX, MAX_SEQ, batch_size=4)
    vl = _pass(engine, tiny_verifier, conversations, tmp_path / "vllm", regenerate=False)
    assert vl["mode"] == "prefill" and vl["samples"] == hf["samples"] == 24
    a, b = _files(tmp_path / "hf"), _files(tmp_path / "vllm")
    assert a.keys() == b.keys() - {"rows.json"}  # the vllm backend's dataset is a view over row artifacts
    for name in a:
        if not name.startswith("hidden_states/"):
            assert a[name] == b[name], name
    worst = (1.0, 0.0)
    for name in (n for n in a if n.startswith("hidden_states/hs_")):
        x, y = load_file(tmp_path / "hf" / name), load_file(tmp_path / "vllm" / name)
        assert torch.equal(x["token_ids"], y["token_ids"]) and x["hidden_states"].dtype == y["hidden_states"].dtype
        cos, rel = _compare(x["hidden_states"], y["hidden_states"])
        worst = (min(worst[0], cos), max(worst[1], rel))
    assert worst[0] > 0.9995 and worst[1] < 0.02, worst


def _mk(p: Path) -> Path:
    p.mkdir()
    return p


KILLED_CLIENT = """
import sys
from pathlib import Path
from eaglet.capture.engine import Engine
from eaglet.capture.vllm import generate_and_capture
engine = Engine.model_validate_json(sys.argv[1])
generate_and_capture(engine, sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), [2, 4, 5, 8], 128,
                     max_new_tokens=32)
"""


def _published_rows(home: Path) -> dict[str, int]:
    """{row key: its first file's modification time} of every published row artifact under the store `home`."""
    return {m.parent.name: (m.parent / "hs_0.safetensors").stat().st_mtime_ns
            for m in (home / "rows").glob("*/manifest.json")}


def test_kill_9_mid_pass_then_resume_computes_no_row_twice(engine, tiny_verifier, conversations, tmp_path,
                                                             one_pass, monkeypatch):
    home = tmp_path / "store"  # its own store: the module's other passes already hold these rows
    monkeypatch.setenv("EAGLET_HOME", str(home))
    out = _mk(tmp_path / "killed")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, engine.model_dump_json(), str(tiny_verifier),
                             str(conversations), str(out)], cwd=ROOT, env=dict(os.environ))
    try:
        while len(_published_rows(home)) < 6:
            assert proc.poll() is None, "the pass ended before it could be killed"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    done = _published_rows(home)
    assert 6 <= len(done) < 24
    stats = generate_and_capture(engine, str(tiny_verifier), conversations, _mk(tmp_path / "resumed"), LAYERS,
                                 MAX_SEQ, max_new_tokens=NEW)
    assert stats["rows_reused"] == len(done) and stats["rows_computed"] == 24 - len(done) and stats["samples"] == 24
    after = _published_rows(home)
    assert len(after) == 24 and all(after[k] == t for k, t in done.items())  # kept as they were: computed once
    full, _ = one_pass  # the resumed artifact holds the same samples as an uninterrupted pass
    from datasets import load_from_disk

    assert [r.tolist() for r in load_from_disk(str(tmp_path / "resumed"))["input_ids"]] == \
        [r.tolist() for r in load_from_disk(str(full))["input_ids"]]


def test_only_new_or_edited_rows_reach_the_verifier(engine, tiny_verifier, tmp_path, monkeypatch):
    """Row-level reuse: append -> only the new rows are computed; edit one row -> that row; reorder or delete rows
    -> nothing computed (no engine at all); other aux layers -> every row again; a deleted row is not in the
    dataset; gc keeps the rows a kept dataset links and deletes the others."""
    from datasets import load_from_disk

    from eaglet import store
    from eaglet.capture.rows import view_rows
    from eaglet.data import read_conversations, write_conversations

    monkeypatch.setenv("EAGLET_HOME", str(tmp_path / "store"))
    rows = read_conversations(write_echo_conversations(tmp_path / "all.jsonl", 22))
    files = {}

    def pass_over(name: str, convs: list, eng=engine) -> dict:
        write_conversations(tmp_path / f"{name}.jsonl", convs)
        files[name] = tmp_path / f"{name}.jsonl"
        return _pass(eng, tiny_verifier, files[name], tmp_path / name)

    first = pass_over("first", rows[:16])
    assert (first["rows_computed"], first["rows_reused"]) == (16, 0)
    edited = [list(m) for m in rows[:16]]
    edited[3] = [{"role": "user", "content": edited[3][0]["content"] + " Briefly."}, edited[3][1]]
    grown = pass_over("grown", edited + rows[16:])  # 6 appended rows and one edited row
    assert (grown["rows_computed"], grown["rows_reused"], grown["samples"]) == (7, 15, 22)
    assert grown["generated_tokens"] > 0 and set(view_rows(tmp_path / "grown")["computed"]) <= \
        set(view_rows(tmp_path / "grown")["rows"])
    shuffled = pass_over("shuffled", list(reversed(edited + rows[16:])), eng=None)  # no engine: nothing to compute
    assert (shuffled["rows_computed"], shuffled["samples"]) == (0, 22)
    with pytest.raises(RuntimeError, match="^22 rows need the verifier"):  # states of other layers: none reused
        generate_and_capture(None, str(tiny_verifier), files["shuffled"], _mk(tmp_path / "aux"),
                             capture_layers([1, 4, 5], 8), MAX_SEQ, max_new_tokens=NEW)
    kept = edited[:5] + edited[7:] + rows[16:]  # rows 5 and 6 deleted
    fewer = pass_over("fewer", kept, eng=None)
    assert (fewer["rows_computed"], fewer["samples"]) == (0, 20)
    trained = {tuple(ids.tolist()) for ids in load_from_disk(str(tmp_path / "fewer"))["input_ids"]}
    grown_ids = [tuple(ids.tolist()) for ids in load_from_disk(str(tmp_path / "grown"))["input_ids"]]
    deleted = {grown_ids[5], grown_ids[6]}
    assert len(trained) == 20 and not trained & deleted

    # gc: a dataset published in the store keeps its 20 rows; the 2 deleted rows and row 3's old version go.
    linked = view_rows(tmp_path / "fewer")["rows"]
    view = store.publish("hidden_states", "v1", lambda work: _pass(None, tiny_verifier, files["fewer"], work)
                         ["file_sha256"], inputs={"links": {"rows": linked}})
    assert len(list((tmp_path / "store" / "rows").glob("*/manifest.json"))) == 23
    ls = run_cli(["cache", "ls"], env_extra={"EAGLET_HOME": str(tmp_path / "store")})
    assert "(20 rows: 0 computed by its run, 20 reused)" in ls.stdout, ls.stdout + ls.stderr
    assert any(line.split()[:2] == ["rows", "23"] for line in ls.stdout.splitlines()), ls.stdout
    removed = store.gc(keep_last=1)
    assert {a["key"] for a in removed if a["kind"] == "rows"} == set(view_rows(tmp_path / "first")["rows"] +
                                                                      view_rows(tmp_path / "grown")["rows"]) - set(linked)
    assert len([a for a in removed if a["kind"] == "rows"]) == 3
    assert store.intact(view) and len(load_from_disk(str(view))) == 20


def _kill_when_busy(storage_of, store_dir: Path, timeout: float = 900) -> tuple[dict, threading.Thread]:
    """An engine dying mid-pass: once its capture directory (storage_of(): the directory or None) holds its first
    hidden-state file (it answered the run's probe or a request), or the run's store (`store_dir`) its first
    published row (a file can come and go between two looks), its process group (the guard of
    eaglet.capture.engine whose command line names that directory, found while the engine starts) is frozen
    with SIGSTOP, so every request the pass deals it stays in flight, and killed with SIGKILL two seconds later."""
    import psutil

    killed: dict = {}

    def busy(storage: Path) -> bool:
        return (storage.is_dir() and any(e.name.endswith(".safetensors") for e in os.scandir(storage))
                or any(store_dir.glob("row*/*/manifest.json")))

    def watch() -> None:
        deadline = time.monotonic() + timeout
        guard = None
        while time.monotonic() < deadline:
            storage = storage_of()
            if storage is not None and guard is None:
                guard = next((p for p in psutil.process_iter(["cmdline"]) if "eaglet.capture.engine" in
                              (p.info["cmdline"] or []) and any(str(storage) in a for a in p.info["cmdline"])),
                             None)
            if guard is not None and busy(storage):
                os.killpg(guard.pid, signal.SIGSTOP)
                time.sleep(2)
                os.killpg(guard.pid, signal.SIGKILL)
                killed["storage"] = storage
                return
            time.sleep(0.002 if guard is not None else 0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return killed, thread


def _served(sets: list[str], port: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return subprocess.Popen([sys.executable, "-m", "deployments.cli", "verifier", "serve", *sets, "--port",
                             str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _ready(server: subprocess.Popen) -> Path:
    """Wait for `eaglet verifier serve`'s ready line; its capture directory."""
    line = ""
    while "ready at" not in line:
        line = server.stdout.readline()
        assert line or server.poll() is None, "eaglet verifier serve exited"
    return Path(line.split("captures in ", 1)[1].rstrip(")\n"))


def _shares_add_up(r: dict, store_dir: Path, killed_endpoint: str, streamed: int = 0) -> None:
    """Every planned row computed once (each engine's share of the published rows adds up to the rows computed,
    and the store holds each row once, `streamed` of them as token ids only); the killed engine taken out, the
    other not."""
    x = r["extraction"]
    shares = {e["endpoint"]: e for e in x["engines"]}
    assert len(shares) == 2 and shares[killed_endpoint]["taken_out"], x["engines"]
    assert all(e["taken_out"] is None for name, e in shares.items() if name != killed_endpoint), x["engines"]
    assert x["rows_computed"] == x["rows"] > 0  # a fresh store: every planned row computed
    assert sum(e["rows"] for e in shares.values()) == x["rows_computed"]
    assert len(list((store_dir / "rows").glob("*/manifest.json"))) == x["rows"] - streamed
    assert len(list((store_dir / "row_ids").glob("*/manifest.json"))) == streamed


def test_two_served_verifiers_one_killed_mid_pass(tiny_verifier, session_dir):
    """Two `eaglet verifier serve` engines given as two URLs: a run uses both (verifier_loads 0) and completes on
    one when the other dies mid-pass; a run whose layers differ is refused before any work."""
    ports = [free_port(), free_port()]
    sets = [f"--set={s}" for s in TINY_RUN + [f"verifier.path={tiny_verifier}"]]
    servers = [_served(sets, port) for port in ports]  # both load at once
    try:
        storages = [_ready(server) for server in servers]
        endpoints = [f"http://127.0.0.1:{port}" for port in ports]
        store_dir = session_dir / "served-store"  # not the e2e run's store: its tasks must build
        own = {"EAGLET_HOME": str(store_dir)}
        wrong = run_cli(["run", *sets, "--set=verifier.aux_layer_ids=[1,3,5]",
                         f"--set=verifier.endpoint={endpoints[0]}", "--output-dir", str(session_dir / "wrong-endpoint")],
                        env_extra=own)
        assert wrong.returncode == 2 and "captures other layers" in wrong.stderr, wrong.stderr[-2000:]
        assert "load-verifier" not in wrong.stdout + wrong.stderr
        out = session_dir / "served"
        killed, watcher = _kill_when_busy(lambda: storages[1], store_dir)
        # 64 of the shipped prompts (the e2e settings answer all 960): what is checked is where the pass ran
        proc = run_cli(["run", *sets, "--set=data.max_samples=64", "--set=data.max_new_tokens=32",
                        "--set=training.epochs=1", "--set=smoke.enabled=false",
                        f"--set=verifier.endpoint={','.join(endpoints)}", "--output-dir", str(out)], env_extra=own)
        watcher.join(timeout=10)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert killed, "the second server was never asked for states"
        r = json.loads((out / "report.json").read_text())
        assert r["verifier_loads"] == 0 and r["engine_loads"]["data"] == 0
        assert r["tasks"]["generate-and-capture"]["state"] == "Completed"
        assert r["extraction"]["samples"] > 0 and r["extraction"]["generated_tokens"] > 0
        _shares_add_up(r, store_dir, endpoints[1])
        assert "taken out" in (out / "report.md").read_text()
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)  # the CLI stops its engine, then exits
        for server in servers:
            try:
                server.wait(timeout=120)
            finally:
                try:
                    os.killpg(server.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_two_capture_engines_one_killed_mid_pass_and_states_past_the_disk_budget_streamed(tiny_verifier,
                                                                                          session_dir):
    """extraction.data_parallel_size=2: the run starts two capture engines (two verifier loads), deals the rows out
    and completes on one when the other dies mid-pass; both engines' scratch is removed after the run.
    extraction.disk_budget_gb in the same run: rows kept up to the budget, the rest streamed to speculators'
    training by the surviving engine (the other stopped first), kept up through training and stopped after it (its
    own step); the report says bytes kept, samples streamed and the forward passes training asked for. Then
    extraction.states=stream on the same rows: its draft is keyed like the first (same content), so vocabulary
    and training are cache hits and no verifier loads."""
    store_dir, out = session_dir / "dp-store", session_dir / "dp"
    own = {"EAGLET_HOME": str(store_dir)}
    engines_dir = store_dir / ".engines"
    killed, watcher = _kill_when_busy(lambda: next(engines_dir.glob("*-1"), None) if engines_dir.is_dir() else None,
                                      store_dir)
    sets = [f"--set={s}" for s in TINY_RUN + [f"verifier.path={tiny_verifier}", "extraction.data_parallel_size=2",
                                              "data.max_samples=48", "data.max_new_tokens=32", "training.epochs=1",
                                              "smoke.enabled=false"]]
    proc = run_cli(["run", *sets, "--set=extraction.disk_budget_gb=0.001", "--output-dir", str(out)],
                   env_extra=own)
    watcher.join(timeout=10)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert killed, "the second engine was never asked for states"
    r = json.loads((out / "report.json").read_text())
    assert r["verifier_loads"] == 2 and r["engine_loads"]["data"] == 2
    second = [e["endpoint"] for e in r["extraction"]["engines"]][1]
    x = r["extraction"]
    _shares_add_up(r, store_dir, second, streamed=x["rows_streamed"])
    report_md = (out / "report.md").read_text()
    assert "capture engines:" in report_md and "samples streamed; training asked the verifier for" in report_md
    assert not list(engines_dir.iterdir())

    kept = sum(f.stat().st_size for f in (store_dir / "rows").rglob("hs_*.safetensors"))
    assert 0 < kept == x["bytes_kept"] <= 1e6 and 0 < x["samples_streamed"] < x["samples"], x
    names = list(r["tasks"])
    assert (names.index("load-verifier") < names.index("stop-spare-engines") < names.index("train-draft")
            < names.index("stop-verifier"))  # training streams from the surviving engine alone
    assert r["streamed"]["engine_requests"] >= x["samples_streamed"]  # every streamed sample, once an epoch at least
    ls = run_cli(["cache", "ls"], env_extra=own)
    assert "states not kept, not reusable" in ls.stdout and "row_ids" in ls.stdout, ls.stdout

    again = run_cli(["run", *sets, "--set=extraction.states=stream", "--output-dir", str(session_dir / "streamed")],
                    env_extra=own)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    r2 = json.loads((session_dir / "streamed" / "report.json").read_text())
    assert r2["verifier_loads"] == 0 and "load-verifier" not in r2["tasks"]
    assert r2["tasks"]["train-draft"]["state"] == "Cached"
    assert r2["artifacts"]["hidden_states"] != r["artifacts"]["hidden_states"]
    assert r2["extraction"]["bytes_kept"] == 0 and r2["extraction"]["samples_streamed"] == x["samples_streamed"]


def test_streamed_rows_keep_only_their_ids_and_a_budget_keeps_at_most_its_bytes(engine, tiny_verifier,
                                                                                  conversations, tmp_path,
                                                                                  monkeypatch):
    """extraction.states=stream: the pass stores no states (each row's token ids, loss mask and answer only: a
    row_ids artifact) and its view links none; prefill-only rows need no engine at all. extraction.disk_budget_gb:
    rows are kept while the budget holds them and the rest streamed, in one view; a budget below one row is one
    sentence, before any request."""
    from datasets import load_from_disk

    from eaglet.capture.rows import STREAMED_KIND, view_rows
    from eaglet.capture.vllm import check_budget, decide_rows, plan_rows, capture_settings, row_estimate

    store_dir = tmp_path / "store"
    monkeypatch.setenv("EAGLET_HOME", str(store_dir))
    streamed = _pass(engine, tiny_verifier, conversations, tmp_path / "stream", states="stream")
    assert streamed["rows_streamed"] == streamed["rows"] == 24 and streamed["samples_streamed"] == 24
    assert streamed["bytes_kept"] == streamed["bytes_linked"] == 0 and streamed["generated_tokens"] > 0
    assert not list(store_dir.rglob("*.safetensors")) and not list((tmp_path / "stream").rglob("hs_*"))
    assert len(list((store_dir / STREAMED_KIND).glob("*/manifest.json"))) == 24
    view = load_from_disk(str(tmp_path / "stream"))
    assert len(view) == 24 and sum(view["seq_len"]) == streamed["tokens"]
    assert len(view_rows(tmp_path / "stream")["streamed"]) == 24

    prefill = _pass(None, tiny_verifier, conversations, tmp_path / "prefill", regenerate=False, states="stream")
    assert prefill["rows_streamed"] == 24 and prefill["rows_computed"] == 0 and prefill["extracted_tokens"] == 0

    # the budget: half of what keeping every row would take; the answers are known now (the streamed rows' ids)
    token_bytes = streamed["bytes_per_token"]
    total = sum(row_estimate(int(n), 1, token_bytes) for n in view["seq_len"])
    budget = total // 2
    mixed = _pass(engine, tiny_verifier, conversations, tmp_path / "mixed", budget_bytes=budget)
    kept = sum(f.stat().st_size for f in (store_dir / "rows").rglob("hs_*.safetensors"))
    assert 0 < kept == mixed["bytes_kept"] <= budget, (kept, budget)
    assert 0 < mixed["rows_streamed"] < 24 and mixed["rows_computed"] == 24 - mixed["rows_streamed"]
    assert len(list((tmp_path / "mixed" / "hidden_states").iterdir())) == 24 - mixed["rows_streamed"]

    settings = capture_settings(LAYERS, MAX_SEQ, "bfloat16", True, NEW, 0.0, 1, 0)
    planned, _ = plan_rows(str(tiny_verifier), conversations, resolve_verifier(tiny_verifier, AUX).fingerprint,
                           settings)
    rows, _ = decide_rows(planned, True, "keep", budget, token_bytes)  # a second run: every row known, none to do
    assert not rows["keep"] and not rows["pending"] and len(rows["streamed_known"]) == mixed["rows_streamed"]
    with pytest.raises(EagletError, match=r"^extraction.disk_budget_gb=1e-06 holds no row: the shortest new row "):
        check_budget(planned, 1000, token_bytes)

