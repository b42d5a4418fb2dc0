"""The measurements, one function per row group. Each comparison runs back to back in one process (or one
process tree) and is repeated; the runner quotes medians and ratios.

- orchestration: the whole flow through `eaglet run` (cold, fully cached, training-only change) + per-task memory
- extraction:    the extract-hidden-states task vs a bare verifier forward pass over the same batches
- training:      the train-draft task vs speculators' own training entry point on the same data and settings
- storage:       bytes per token of the stored hidden states, bf16 and fp8
- decoding:      vLLM with and without the draft, k = 1..K, batch 1 and batched
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.memory import TreeRSS

ROOT = Path(__file__).resolve().parent.parent


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --- orchestration ----------------------------------------------------------------------------------------

def run_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"EAGLET_HOME": str(home / "store"), "PREFECT_HOME": str(home / "prefect"),
                "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "prefect-results")})
    return env


def eaglet_run(home: Path, sets: list[str], out: Path) -> dict:
    """One `eaglet run` in its own process; wall time, report, and the peak RSS of its process tree per task."""
    cmd = [sys.executable, "-m", "deployments.cli", "run", *[f"--set={s}" for s in sets], "--output-dir", str(out)]
    t0 = time.perf_counter()
    log = open(out.with_suffix(".log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env(home), stdout=log, stderr=subprocess.STDOUT)
    with TreeRSS(proc.pid) as mem:
        rc = proc.wait()
    wall = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"eaglet run failed (exit {rc}); see {out.with_suffix('.log')}")
    report = json.loads((out / "report.json").read_text())
    tasks = {}
    for name, t in report["tasks"].items():
        peak = mem.peak(t["started"], t["started"] + t["seconds"] + mem.interval)
        tasks[name] = {"state": t["state"], "seconds": t["seconds"], "peak_rss_bytes": peak}
    return {"wall_s": wall, "tasks_s": sum(t["seconds"] for t in report["tasks"].values()), "tasks": tasks,
            "peak_rss_bytes": mem.peak(), "report": report}


def orchestration(home: Path, sets: list[str], changed: str, repeats: int) -> dict:
    cold = eaglet_run(home, sets, home / "cold")
    cached = [eaglet_run(home, sets, home / f"cached{i}") for i in range(repeats)]
    change = eaglet_run(home, sets + [changed], home / "changed")
    med_cached = _median([c["wall_s"] for c in cached])
    return {
        "cold_s": cold["wall_s"],
        "cached_s": [c["wall_s"] for c in cached],
        "cached_median_s": med_cached,
        "cached_over_cold": med_cached / cold["wall_s"],
        "cached_states": sorted({t["state"] for c in cached for n, t in c["tasks"].items()
                                 if n not in ("resolve-verifier", "validate-draft")}),
        "training_change": changed,
        "training_change_s": change["wall_s"],
        "training_change_over_cold": change["wall_s"] / cold["wall_s"],
        "training_change_states": {n: t["state"] for n, t in change["tasks"].items()},
        "overhead_s": {"cold": cold["wall_s"] - cold["tasks_s"],
                       "cached_median": _median([c["wall_s"] - c["tasks_s"] for c in cached])},
        "memory": {n: t["peak_rss_bytes"] for n, t in cold["tasks"].items()},
        "cold_tasks_s": {n: t["seconds"] for n, t in cold["tasks"].items()},
        "cold_report": cold["report"],
    }


# --- extraction, training, storage (the pipeline's own Prefect tasks, in one flow) ---------------------------

def bare_forward_tokens_per_s(verifier_path: str, conversations_file: Path, max_seq_len: int,
                              batch_size: int, model) -> float:
    """The limit: the verifier's forward pass (hidden states requested) over exactly the pipeline's batches,
    nothing captured, copied or written. `model` freshly loaded, as the pipeline's is: a model's first passes
    pay one-off kernel set-up (weight packing) that a warm model would not."""
    import torch
    from transformers import AutoTokenizer

    from eaglet.data import read_conversations, tokenize_conversations
    from eaglet.capture.hf_forward import pad_batch

    tok = AutoTokenizer.from_pretrained(verifier_path)
    samples, _ = tokenize_conversations(tok, read_conversations(conversations_file), max_seq_len)
    order = sorted(range(len(samples)), key=lambda i: -samples[i]["seq_len"])
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    device = next(model.parameters()).device
    seconds, tokens = 0.0, 0
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            batch = [samples[i]["input_ids"] for i in order[b : b + batch_size]]
            ids, attn = pad_batch(batch, pad)
            t0 = time.perf_counter()
            model.model(input_ids=ids.to(device), attention_mask=attn.to(device), output_hidden_states=True)
            if device.type == "cuda":
                torch.cuda.synchronize()  # kernels run asynchronously: wait before reading the clock
            seconds += time.perf_counter() - t0
            tokens += sum(len(x) for x in batch)
    return tokens / seconds


def stages(home: Path, verifier_path: str, conversations_dir: str, cfg, repeats: int) -> dict:
    """Runs in a Prefect flow (the tasks need a run context). Every pipeline repeat gets a fresh store, so the
    task builds instead of hitting the cache."""
    from prefect import flow

    from eaglet.capture.hf_forward import load_verifier, resolve_device
    from eaglet.train import speculators_argv
    from eaglet.verifier import resolve_verifier
    from tasks import stages as t

    def fresh_store(name: str) -> None:
        os.environ["EAGLET_HOME"] = str(home / name)

    @flow(name="bench-stages")
    def bench_stages() -> dict:
        info = resolve_verifier(verifier_path, cfg.verifier.aux_layer_ids, False)
        conv_file = Path(conversations_dir) / "train.jsonl"
        extraction = {"pipeline_tokens_per_s": [], "bare_tokens_per_s": []}
        for r in range(repeats):
            fresh_store(f"x{r}")
            states = t.extract_hidden_states.with_options(refresh_cache=True)(info, conversations_dir, cfg)
            stats = json.loads((Path(states) / "stats.json").read_text())
            extraction["pipeline_tokens_per_s"].append(stats["tokens_per_s"])
            bare_model = load_verifier(verifier_path, resolve_device(cfg.extraction.device))
            extraction["bare_tokens_per_s"].append(bare_forward_tokens_per_s(
                verifier_path, conv_file, cfg.data.max_seq_len, cfg.extraction.batch_size, bare_model))
            del bare_model
            if r == 0:
                states0, stats0 = states, stats
        extraction["tokens"] = stats0["tokens"]
        extraction["samples"] = stats0["samples"]

        fresh_store("x0")
        vocab = t.build_vocab(info, states0, cfg)
        training = {"pipeline_s": [], "direct_s": [], "tokens": stats0["tokens"] * cfg.training.epochs}
        for r in range(repeats):  # alternating, each in a fresh process
            training["pipeline_s"].append(_train_once("pipeline", {
                "store": str(home / f"t{r}"), "verifier": info.model_dump(), "cfg": cfg.model_dump(),
                "states": states0, "vocab": vocab}, home / f"pipeline{r}"))
            training["direct_s"].append(_train_once("direct", {"argv": speculators_argv(
                info.path, Path(states0), Path(vocab), home / f"direct{r}" / "checkpoints", info.aux_layer_ids,
                cfg.draft.draft_vocab_size, cfg.draft, cfg.training, False)}, home / f"direct{r}"))

        fresh_store("fp8")
        fp8 = t.extract_hidden_states.with_options(refresh_cache=True)(
            info, conversations_dir, cfg.model_copy(update={"extraction": cfg.extraction.model_copy(
                update={"dtype": "fp8"})}))
        storage = {"bf16": _bytes_per_token(Path(states0), stats0),
                   "fp8": _bytes_per_token(Path(fp8), json.loads((Path(fp8) / "stats.json").read_text()))}
        return {"extraction": extraction, "training": training, "storage": storage}

    return bench_stages()


def _train_once(mode: str, spec: dict, work: Path) -> float:
    """One timed training run in a fresh process (bench/train_once.py), so both sides start alike."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec, default=str))
    proc = subprocess.run([sys.executable, "-m", "bench.train_once", mode, str(work / "spec.json")], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} training failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]


def _bytes_per_token(states: Path, stats: dict) -> dict:
    on_disk = sum(f.stat().st_size for f in (states / "hidden_states").glob("hs_*.safetensors"))
    return {"nominal": stats["bytes_per_token"], "on_disk": on_disk / stats["tokens"],
            "tokens_per_s": stats["tokens_per_s"]}


# --- decoding -------------------------------------------------------------------------------------------------

def decoding(verifier_path: str, draft: str, prompts: list, ks: list[int], max_tokens: int, batch1: int,
             max_model_len: int, dtype: str = "float32") -> dict:
    """Greedy decoding in vLLM on held-out prompts: all at once, then the first `batch1` one at a time. One
    engine per configuration; a short warm-up generation first. float32 by default: on CPU, bfloat16 makes
    greedy outputs with and without the draft differ (see eaglet/smoke.py), and then the two runs decode
    different tokens and their speeds are not comparable; `identical_outputs` says whether they were."""
    from eaglet.vllm_run import run_vllm_job

    job = {"verifier": verifier_path, "conversations": prompts, "max_tokens": max_tokens, "dtype": dtype,
           "max_model_len": max_model_len, "temperature": 0.0, "batch1": batch1, "warmup": True}
    base = run_vllm_job(job)
    rows = []
    for k in ks:
        spec = run_vllm_job(dict(job, draft=draft, k=k))
        c = spec["spec"]
        drafts = c["drafts"]
        rows.append({
            "k": k,
            "mean_acceptance_length": 1.0 + c["accepted"] / drafts if drafts else 1.0,
            "acceptance_per_position": [a / drafts if drafts else 0.0 for a in c["accepted_per_pos"]],
            "tokens_per_s_batched": spec["tokens_per_s"],
            "tokens_per_s_batch1": spec["batch1"]["tokens_per_s"],
            "speedup_batched": spec["tokens_per_s"] / base["tokens_per_s"],
            "speedup_batch1": spec["batch1"]["tokens_per_s"] / base["batch1"]["tokens_per_s"],
            "identical_outputs": spec["token_ids"] == base["token_ids"],
        })
    return {"prompts": len(prompts), "batch1_prompts": batch1, "max_tokens": max_tokens, "dtype": dtype,
            "baseline_tokens_per_s_batched": base["tokens_per_s"],
            "baseline_tokens_per_s_batch1": base["batch1"]["tokens_per_s"], "k": rows}


TIMING_NOISE = 0.05  # two timed runs of the same work differ by a few percent on these machines


def decoding_checks(dec: dict) -> list[str]:
    """Invariants of speculative decoding: a draft of k tokens adds at most k per step (length <= k + 1,
    exact: counters), and it cannot speed decoding up by more than the tokens each step yields (speedup <=
    length, up to TIMING_NOISE: timings)."""
    problems = []
    for r in dec["k"]:
        if r["mean_acceptance_length"] > r["k"] + 1 + 1e-9:
            problems.append(f"k={r['k']}: mean acceptance length {r['mean_acceptance_length']:.3f} > k+1")
        for batch in ("batched", "batch1"):
            if r[f"speedup_{batch}"] > r["mean_acceptance_length"] * (1 + TIMING_NOISE):
                problems.append(f"k={r['k']}: {batch} speedup {r[f'speedup_{batch}']:.3f} exceeds the mean "
                                f"acceptance length {r['mean_acceptance_length']:.3f}")
    return problems
