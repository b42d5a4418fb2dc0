"""The measurements, one function per row group. Each comparison is repeated with its sides interleaved
(A B A B ...), so drift on the machine hits both; the runner quotes min / median / max.

- orchestration: the whole flow through `eaglet run` (cold, fully cached, training-only change) + per-task memory
- data pass:     load-verifier + generate-and-capture vs a bare vLLM server generating the same requests
                 (bench.datapass): steady-state tokens/s and start-up seconds apart
- extraction:    the hf backend's extract-hidden-states task vs a bare verifier forward pass over the same batches
- training:      the train-draft task vs speculators' own training entry point on the same data and settings
                 (bench.steps: steady-state tokens/s from speculators' steps, start-up seconds itemised), plus one
                 pair at a realistic length (the comparison's first pair where that length is the run's own)
- storage:       bytes per token of the stored hidden states, bf16 and fp8
- decoding:      vLLM with and without the draft, k = 1..K, batched; batch 1 interleaved in one process
                 (bench.decode_pair)
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


# Tasks without a content key: they run (cheaply) on every run, cached or not.
UNKEYED = ("resolve-verifier", "plan-capture", "plan-training", "find-warm-start", "validate-draft")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> dict:
    """min / median / max of the repeats (n of them)."""
    return {"n": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs)}


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


def orchestration(home: Path, sets: list[str], changed: str | None, repeats: int) -> dict:
    """A cold run, `repeats` fully cached reruns, and (`changed` set) a run with that one training setting
    changed."""
    cold = eaglet_run(home, sets, home / "cold")
    cached = [eaglet_run(home, sets, home / f"cached{i}") for i in range(repeats)]
    change = eaglet_run(home, sets + [changed], home / "changed") if changed else None
    med_cached = _median([c["wall_s"] for c in cached])
    return {
        "cold_s": cold["wall_s"],
        "cached_s": [c["wall_s"] for c in cached],
        "cached_median_s": med_cached,
        "cached_spread_s": spread([c["wall_s"] for c in cached]),
        "cached_over_cold": med_cached / cold["wall_s"],
        "cached_states": sorted({t["state"] for c in cached for n, t in c["tasks"].items() if n not in UNKEYED}),
        "training_change": changed,
        **({"training_change_s": change["wall_s"],
            "training_change_over_cold": change["wall_s"] / cold["wall_s"],
            "training_change_states": {n: t["state"] for n, t in change["tasks"].items()}} if change else {}),
        "overhead_s": {"cold": cold["wall_s"] - cold["tasks_s"],
                       "cached_median": _median([c["wall_s"] - c["tasks_s"] for c in cached]),
                       "cached": spread([c["wall_s"] - c["tasks_s"] for c in cached])},
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


def stages(home: Path, verifier_path: str, conversations_dir: str, data_dir: str, cfg, p: dict) -> dict:
    """Runs in a Prefect flow (the tasks need a run context). Every pipeline repeat gets a fresh store, so the
    task builds instead of hitting the cache."""
    from prefect import flow

    from bench import datapass
    from eaglet.capture.hf_forward import load_hf_model, resolve_device
    from eaglet.verifier import resolve_verifier
    from tasks import stages as t

    repeats = p["repeats"]

    def fresh_store(name: str) -> None:
        os.environ["EAGLET_HOME"] = str(home / name)

    @flow(name="bench-stages")
    def bench_stages() -> dict:
        data_pass = datapass.compare(home, verifier_path, data_dir, cfg, repeats)

        info = resolve_verifier(verifier_path, cfg.verifier.aux_layer_ids, False)
        conv_file = Path(conversations_dir) / "train.jsonl"
        extraction = {"pipeline_tokens_per_s": [], "bare_tokens_per_s": []}
        for r in range(repeats):
            fresh_store(f"x{r}")
            states = t.extract_hidden_states.with_options(refresh_cache=True)(info, conversations_dir, cfg)
            stats = json.loads((Path(states) / "stats.json").read_text())
            extraction["pipeline_tokens_per_s"].append(stats["tokens_per_s"])
            bare_model = load_hf_model(verifier_path, resolve_device(cfg.extraction.device))
            extraction["bare_tokens_per_s"].append(bare_forward_tokens_per_s(
                verifier_path, conv_file, cfg.data.max_seq_len, cfg.extraction.batch_size, bare_model))
            del bare_model
            if r == 0:
                states0, stats0 = states, stats
        extraction["tokens"] = stats0["tokens"]
        extraction["samples"] = stats0["samples"]

        fresh_store("x0")
        vocab = t.build_vocab(info, states0, None, cfg)
        training = training_pairs(home, "", info, cfg, states0, vocab, repeats, p["warm_steps"], conversations_dir)
        if p["realistic_epochs"] == cfg.training.epochs:  # one pair at the run's own epochs: the comparison's first
            realistic = {**training, "pipeline": training["pipeline"][:1], "direct": training["direct"][:1],
                         "reused": "the comparison's first pair"}
        else:
            long_cfg = cfg.model_copy(update={"training": cfg.training.model_copy(
                update={"epochs": p["realistic_epochs"]})})
            realistic = training_pairs(home, "long", info, long_cfg, states0, vocab, 1, p["warm_steps"],
                                       conversations_dir)

        fresh_store("fp8")
        fp8 = t.extract_hidden_states.with_options(refresh_cache=True)(
            info, conversations_dir, cfg.model_copy(update={"extraction": cfg.extraction.model_copy(
                update={"dtype": "fp8"})}))
        storage = {"bf16": _bytes_per_token(Path(states0), stats0),
                   "fp8": _bytes_per_token(Path(fp8), json.loads((Path(fp8) / "stats.json").read_text()))}
        return {"data_pass": data_pass, "extraction": extraction, "training": training,
                "training_realistic": realistic, "storage": storage}

    return bench_stages()


def training_pairs(home: Path, tag: str, info, cfg, states: str, vocab: str, repeats: int, warm_steps: int,
                   data_dir: str) -> dict:
    """`repeats` pairs, interleaved (pipeline, direct, pipeline, ...), each run in a fresh process. data_dir: the
    conversations the states were extracted from (train-draft records their prompts as the draft's lineage)."""
    from bench.steps import profile
    from eaglet.drafts import registry
    from eaglet.train.launch import speculators_argv

    pipeline, direct = [], []
    for r in range(repeats):
        run = _train_once("pipeline", {"store": str(home / f"t{tag}{r}"), "verifier": info.model_dump(),
                                       "cfg": cfg.model_dump(), "states": states, "vocab": vocab, "data": data_dir},
                          home / f"pipeline{tag}{r}")
        pipeline.append(profile(run, warm_steps))
        run = _train_once("direct", {"argv": speculators_argv(
            registry.for_run(cfg), cfg, info.path, Path(states), Path(vocab), home / f"direct{tag}{r}" / "checkpoints",
            info.aux_layer_ids)}, home / f"direct{tag}{r}")
        direct.append(profile(run, warm_steps))
    if any(p["tokens"] != d["tokens"] for p, d in zip(pipeline, direct)):
        raise RuntimeError("the two training sides saw different token counts: not the same data")
    return {"epochs": cfg.training.epochs, "warm_steps": warm_steps, "pipeline": pipeline, "direct": direct}


def _train_once(mode: str, spec: dict, work: Path) -> dict:
    """One timed training run in a fresh process (bench/train_once.py), so both sides start alike."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec, default=str))
    proc = subprocess.run([sys.executable, "-m", "bench.train_once", mode, str(work / "spec.json")], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} training failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _bytes_per_token(states: Path, stats: dict) -> dict:
    on_disk = sum(f.stat().st_size for f in (states / "hidden_states").glob("hs_*.safetensors"))
    return {"nominal": stats["bytes_per_token"], "on_disk": on_disk / stats["tokens"],
            "tokens_per_s": stats["tokens_per_s"]}


# --- decoding -------------------------------------------------------------------------------------------------

def _batched_row(k: int, spec: dict, base: dict) -> dict:
    """One batched row from a decode result with the draft at k and the verifier-alone result it compares with."""
    c = spec["spec"]
    drafts = c["drafts"]
    return {
        "k": k,
        "mean_acceptance_length": 1.0 + c["accepted"] / drafts if drafts else 1.0,
        "acceptance_per_position": [a / drafts if drafts else 0.0 for a in c["accepted_per_pos"]],
        "drafts": drafts,  # speculative steps the draft proposed for (0: it never ran)
        "tokens_per_s_batched": spec["tokens_per_s"],
        "speedup_batched": spec["tokens_per_s"] / base["tokens_per_s"],
        "seconds_batched": spec["seconds"],
        "identical_outputs": spec["token_ids"] == base["token_ids"],
    }


def decoding(verifier_path: str, draft: str, prompts: list, ks: list[int], max_tokens: int, batch1: dict,
             max_model_len: int, dtype: str = "float32", batched_in_pair: bool = False) -> dict:
    """Greedy decoding in vLLM on held-out prompts, float32 by default: on CPU, bfloat16 makes greedy outputs with
    and without the draft differ (see eaglet/evaluate/smoke.py), and then the two runs decode different tokens and their
    speeds are not comparable; `identical_outputs` says whether they were.
    Batched: all prompts at once, one engine per configuration, a short warm-up generation first.
    Batch 1 (for k in batch1["ks"]): bench.decode_pair, both engines in one process, warmed up, passes of
    batch1["prompts"] prompts one at a time, alternating alone / draft, batch1["repeats"] of each.
    batched_in_pair (the `check` preset, ks == batch1["ks"] == [k]): the batched rows from the batch-1 pair's two
    engines (bench.decode_pair's "batched"), after its passes, instead of two more engines started for them."""
    from eaglet.drafts.registry import of_checkpoint
    from eaglet.vllm import run_job

    method = of_checkpoint(draft).method  # the draft's config says which architecture it is
    if batched_in_pair and not (len(ks) == 1 and list(ks) == list(batch1["ks"])):
        raise ValueError(f"batched_in_pair needs one k, the batch-1 pair's: ks {ks}, batch 1 {batch1['ks']}")
    job = {"verifier": verifier_path, "conversations": prompts, "max_tokens": max_tokens, "dtype": dtype,
           "max_model_len": max_model_len, "temperature": 0.0, "warmup": True}
    rows, base = [], None
    if not batched_in_pair:
        base = run_job(job)
        rows = [_batched_row(k, run_job(dict(job, draft=draft, k=k, method=method)), base) for k in ks]
    b1 = []
    for k in batch1["ks"]:
        res = _decode_pair({"verifier": verifier_path, "draft": draft, "method": method, "k": k, "dtype": dtype,
                            "conversations": prompts[: batch1["prompts"]], "max_tokens": batch1["max_tokens"],
                            "max_model_len": max_model_len, "warmup": batch1["warmup"],
                            "repeats": batch1["repeats"],
                            **({"batched": {"conversations": prompts, "max_tokens": max_tokens}}
                               if batched_in_pair else {})})
        if batched_in_pair:
            base = res["batched"]["alone"]
            rows = [_batched_row(k, res["batched"]["draft"], base)]
        passes = res["passes"]
        lengths = [1.0 + x["draft"]["accepted"] / x["draft"]["drafts"] if x["draft"]["drafts"] else 1.0
                   for x in passes]
        speedups = [x["draft"]["tokens_per_s"] / x["alone"]["tokens_per_s"] for x in passes]
        b1.append({
            "k": k,
            "alone_tokens_per_s": spread([x["alone"]["tokens_per_s"] for x in passes]),
            "draft_tokens_per_s": spread([x["draft"]["tokens_per_s"] for x in passes]),
            "speedup": spread(speedups), "speedups": speedups,
            "mean_acceptance_length": spread(lengths), "acceptance_lengths": lengths,
            "drafts": [x["draft"]["drafts"] for x in passes],
            "identical_outputs": all(x["draft"]["token_ids"] == x["alone"]["token_ids"] for x in passes)
            and all(x["alone"]["token_ids"] == passes[0]["alone"]["token_ids"] for x in passes),
            "load_seconds": res["load_seconds"],
        })
    return {"prompts": len(prompts), "max_tokens": max_tokens, "dtype": dtype, "method": method,
            "baseline_tokens_per_s_batched": base["tokens_per_s"], "baseline_seconds_batched": base["seconds"],
            "k": rows, "batched_engines": "the batch-1 pair's" if batched_in_pair else "one per configuration",
            "batch1": {**batch1, "rows": b1}}


def _decode_pair(job: dict) -> dict:
    """bench.decode_pair in a vLLM child process (eaglet.vllm.run_job: its own session, stopped with it)."""
    from eaglet.vllm import run_job

    # vLLM's own thread binding ("auto"), as the pair was measured with: the batch-1 check has no tolerance
    return run_job(job, module="bench.decode_pair", env={"VLLM_CPU_OMP_THREADS_BIND": "auto"})


BATCHED_TIMING_NOISE = 0.05  # the batched rows are one pass each, not repeated or interleaved
# A batched pass shorter than this is not timed well enough to check: the tiny preset's 64 tokens take ~0.15 s,
# and one such pass in CI measured a speedup of 1.271 at an acceptance length of 1.017 (k=2's, the same minute: 0.805).
MIN_CHECKED_BATCHED_SECONDS = 2.0


def batched_checked(dec: dict, row: dict) -> bool:
    """Whether a batched row's speedup is checked: both its pass and the baseline's lasted long enough."""
    return min(dec.get("baseline_seconds_batched", 1e9), row.get("seconds_batched", 1e9)) >= MIN_CHECKED_BATCHED_SECONDS


def decoding_checks(dec: dict) -> list[str]:
    """Invariants of speculative decoding with a chain draft: a draft of k tokens adds at most k per step (mean
    acceptance length <= k + 1, exact: counters), and each speculative step costs at least one plain step, so no
    speedup can exceed the acceptance length of the tokens it timed. Batch-1 rows (warmed up, repeated,
    interleaved) get no tolerance: a breach is a measurement bug. The batched rows, one pass each, are allowed
    BATCHED_TIMING_NOISE, and only when both passes lasted MIN_CHECKED_BATCHED_SECONDS (batched_checked)."""
    problems = []
    for r in dec["k"]:
        if r["mean_acceptance_length"] > r["k"] + 1 + 1e-9:
            problems.append(f"k={r['k']}: mean acceptance length {r['mean_acceptance_length']:.3f} > k+1")
        if batched_checked(dec, r) and r["speedup_batched"] > r["mean_acceptance_length"] * (1 + BATCHED_TIMING_NOISE):
            problems.append(f"k={r['k']}: batched speedup {r['speedup_batched']:.3f} exceeds the mean "
                            f"acceptance length {r['mean_acceptance_length']:.3f}")
    for r in dec["batch1"]["rows"]:
        for i, (s, a) in enumerate(zip(r["speedups"], r["acceptance_lengths"]), 1):
            if a > r["k"] + 1 + 1e-9:
                problems.append(f"k={r['k']} batch 1, repeat {i}: mean acceptance length {a:.3f} > k+1")
            if s > a:
                problems.append(f"k={r['k']} batch 1, repeat {i}: speedup {s:.3f} exceeds the acceptance length "
                                f"{a:.3f} of the same tokens")
        if not r["identical_outputs"]:
            problems.append(f"k={r['k']} batch 1: outputs differ between passes (the timed work is not the same)")
    return problems
