"""Is the draft worth serving: acceptance per suite and category, and output throughput and latency with and
without the draft at each concurrency level and k.

Every figure comes from vLLM: an OpenAI-compatible server per engine setting (the verifier alone; the verifier
with the draft at each k), loaded by vLLM's own serving benchmark (eaglet.vllm.serving), which also reads the
spec-decode counters. eaglet only decides what is sent (the suites' prompts, the levels) and what the figures
mean: the speedup per level, where the draft stops paying (the crossover), and the k to serve.

The verifier alone depends on the verifier, the suites and the settings, never on the draft: it is measured once
(`measure_verifier_alone`) and kept as an artifact, like the smoke test's baseline.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from eaglet.errors import EagletError
from eaglet.evaluate.smoke import SMOKE_ANSWERS_FILE, answers_job, machine_kind
from eaglet.evaluate.suites import Suite, load_suites
from eaglet.verifier.devices import on_accelerator
from eaglet.vllm import run_job, vllm_env

VERIFIER_ALONE_FILE = "serving.json"
EVALUATION_FILE = "evaluation.json"
CPU_LEVELS, GPU_LEVELS = [1, 8], [1, 8, 32, 128]


def levels(cfg, on_gpu: bool | None = None) -> list[int]:
    """eval.concurrency, or the defaults for this host (a few CPU cores are saturated by 8 requests; a GPU much later);
    the target concurrency is always measured."""
    if cfg.eval.concurrency:
        out = list(cfg.eval.concurrency)
    else:
        if on_gpu is None:
            on_gpu = on_accelerator()
        out = list(GPU_LEVELS if on_gpu else CPU_LEVELS)
    if cfg.eval.target_concurrency and cfg.eval.target_concurrency not in out:
        out.append(cfg.eval.target_concurrency)
    return sorted(set(out))


def k_values(cfg, trained_k: int, on_gpu: bool | None = None) -> list[int]:
    """eval.k, each at most the trained k (a draft never proposes more tokens than it was trained for); else 1..k on
    GPUs, and on a CPU host the trained k alone: each k is one server start, and the acceptance of every shorter
    chain is read from the trained k's per-position rates (`acceptance_by_k`)."""
    if cfg.eval.k:
        ks = sorted(set(cfg.eval.k))
    else:
        if on_gpu is None:
            on_gpu = on_accelerator()
        ks = list(range(1, trained_k + 1)) if on_gpu else [trained_k]
    above = [k for k in ks if k > trained_k]
    if above:
        raise EagletError(f"eval.k asks for k={above[0]}, above the trained k={trained_k}: measure k from 1 to "
                          f"{trained_k}")
    return ks


def acceptance_by_k(per_position: list[float]) -> list[float]:
    """Mean acceptance length at each chain length j up to the one measured: 1 + the rates of positions 1..j. A
    chain's first j proposals do not depend on its length, and position i is accepted only when every position
    before it is; the drafting steps differ between lengths, so this reads the measured k's steps, not a rerun."""
    out, total = [], 1.0
    for rate in per_position:
        total += rate
        out.append(total)
    return out


def check(cfg, trained_k: int) -> list[Suite]:
    """Every evaluation input checked before any load: the suites exist and hold prompts, the k values fit."""
    k_values(cfg, trained_k)
    return load_suites(cfg.eval.suites, cfg.eval.prompts_per_suite)


def requests_at(level: int) -> int:
    """Requests sent at a concurrency level: two waves of it (the first fills the batch, the second measures it
    full), at least 4."""
    return max(4, 2 * level)


def max_model_len(cfg) -> int:
    """A prompt with its answer (eval.max_tokens, or smoke.max_tokens: the trained k's server answers the smoke test);
    every server of an evaluation alike, so that the two sides of a speedup differ by the draft alone."""
    return cfg.data.max_seq_len + max(cfg.eval.max_tokens, cfg.smoke.max_tokens)


def _write_jsonl(path: Path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def _plan(suites: list[Suite], cfg, levels_: list[int], work: Path, left_out: set[str], per_category: bool) -> dict:
    """The runs of one server: the suites' prompts with their greedy texts kept (the lossless check), one run per
    suite and category when its acceptance is measured (vLLM's counters are per run), else one run for all; then one
    run per concurrency level over all suites' prompts interleaved."""
    work.mkdir(parents=True, exist_ok=True)
    runs, groups, per_suite = [], {}, []
    for s in suites:
        kept = [p for p in s.prompts if p.digest not in left_out]
        per_suite.append(kept)
        for cat in s.categories if per_category else []:
            prompts = [p for p in kept if p.category == cat]
            if prompts:
                groups[f"suite/{s.name}/{cat}"] = {"suite": s.name, "category": cat, "prompts": prompts}
    mixed = [ps[i] for i in range(max(map(len, per_suite), default=0)) for ps in per_suite if i < len(ps)]
    if not mixed:
        raise EagletError("every evaluation prompt was seen in training by this draft or its lineage: add suites "
                          "it never trained on (eval.suites)")
    if not per_category:
        groups["suites"] = {"suite": None, "category": None, "prompts": mixed}
    for i, (name, g) in enumerate(groups.items()):
        runs.append({"name": name, "dataset": _write_jsonl(work / f"texts-{i}.jsonl", [p.prompt for p in g["prompts"]]),
                     "num_prompts": len(g["prompts"]), "concurrency": min(len(g["prompts"]), max(levels_)),
                     "max_tokens": cfg.eval.max_tokens, "texts": True})
        g["digests"] = [p.digest for p in g.pop("prompts")]
    sweep = _write_jsonl(work / "sweep.jsonl", [p.prompt for p in mixed])
    for c in levels_:
        runs.append({"name": f"level/{c}", "dataset": sweep, "num_prompts": requests_at(c), "concurrency": c,
                     "max_tokens": cfg.eval.max_tokens, "texts": False})
    return {"runs": runs, "groups": groups}


def _serve(verifier: str, cfg, runs: list[dict], progress=None, draft: str | None = None, method: str | None = None,
           k: int | None = None, answers: dict | None = None) -> dict:
    job = {"verifier": verifier, "dtype": cfg.smoke.dtype, "max_model_len": max_model_len(cfg),
           "runs": runs, "server_env": vllm_env()}
    if cfg.data.chat_template_kwargs:  # data.chat_template_kwargs: the suites' prompts rendered as capture's were
        job["chat_template_kwargs"] = cfg.data.chat_template_kwargs
    if answers:
        job["answers"] = answers
    if draft:
        job |= {"draft": draft, "method": method, "k": k}
    return run_job(job, module="eaglet.vllm.serving", progress=progress)


def _level_row(k: int, c: int, r: dict) -> dict:
    row = {"k": k, "concurrency": c, "requests": r.get("completed"), "failed": r.get("failed"),
           "output_tokens_per_s": r.get("output_throughput"), "ttft_ms_p50": r.get("median_ttft_ms"),
           "ttft_ms_p99": r.get("p99_ttft_ms"), "tpot_ms_p50": r.get("median_tpot_ms"),
           "tpot_ms_p99": r.get("p99_tpot_ms")}
    if k:
        row["acceptance_length"] = r.get("spec_decode_acceptance_length")
    return row


def measure_verifier_alone(verifier: str, cfg, out: Path, progress=None) -> dict:
    """The verifier alone on every suite prompt and at every level: out/serving.json (greedy texts by prompt
    digest, the sweep's rows), with when and where it was measured."""
    suites = load_suites(cfg.eval.suites, cfg.eval.prompts_per_suite)
    lv = levels(cfg)
    plan = _plan(suites, cfg, lv, out / "prompts", left_out=set(), per_category=False)
    result = _serve(verifier, cfg, plan["runs"], progress)
    texts = {}
    for name, g in plan["groups"].items():
        texts |= dict(zip(g["digests"], result["runs"][name].get("texts", [])))
    base = {"levels": [_level_row(0, c, result["runs"][f"level/{c}"]) for c in lv], "texts": texts,
            "suites": [{"name": s.name, "source": s.source, "prompts": len(s.prompts), "categories": s.categories}
                       for s in suites],
            "load_seconds": result["load_seconds"], "machine": machine_kind(),
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    (out / VERIFIER_ALONE_FILE).write_text(json.dumps(base))
    return base


def read_verifier_alone(directory: str | Path) -> dict:
    return json.loads((Path(directory) / VERIFIER_ALONE_FILE).read_text())


def _acceptance(runs: list[dict]) -> dict:
    """Mean acceptance length and per-position rates over runs, weighted by their drafts (vLLM's counters)."""
    drafts = sum(r.get("spec_decode_num_drafts") or 0 for r in runs)
    accepted = sum(r.get("spec_decode_accepted_tokens") or 0 for r in runs)
    per_pos: list[float] = []  # accepted tokens at each position, summed over the runs
    for r in runs:
        for i, rate in enumerate(r.get("spec_decode_per_position_acceptance_rates") or []):
            per_pos += [0.0] * (i + 1 - len(per_pos))
            per_pos[i] += rate * (r.get("spec_decode_num_drafts") or 0)
    return {"mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "per_position": [a / drafts if drafts else 0.0 for a in per_pos], "drafts": drafts}


def evaluate_draft(verifier: str, draft: str, method: str, trained_k: int, cfg, verifier_alone: dict, out: Path,
                   left_out: set[str] | None = None, progress=None, answers: dict | None = None) -> dict:
    """The draft at every k of eval.k on the suites and levels the verifier alone was measured on: out/evaluation.json.
    left_out: prompt digests the draft or its lineage trained on (reported, never measured). answers: the smoke
    test (smoke.answers_job), answered by the trained k's server first (out/smoke-answers.json; a server of its own
    when eval.k leaves the trained k out)."""
    suites = load_suites(cfg.eval.suites, cfg.eval.prompts_per_suite)
    lv, ks = levels(cfg), k_values(cfg, trained_k)
    suite_k = max(ks)  # acceptance per suite and category: at the largest k measured (the trained one by default)
    left_out = left_out or set()
    excluded = {s.name: sum(p.digest in left_out for p in s.prompts) for s in suites}
    plan = _plan(suites, cfg, lv, out / "prompts", left_out=left_out, per_category=True)
    suite_runs = [r for r in plan["runs"] if r["name"].startswith("suite/")]
    level_runs = [r for r in plan["runs"] if r["name"].startswith("level/")]
    rows, per_group, load_seconds, done = [], {}, {}, 0
    total = len(suite_runs) + len(ks) * len(level_runs)
    server_ks = sorted(set(ks) | ({trained_k} if answers else set()))
    for k in server_ks:  # one server per k: vLLM fixes num_speculative_tokens when the engine starts
        runs = (suite_runs if k == suite_k else []) + (level_runs if k in ks else [])
        step = (lambda d, _t, rate, before=done: progress(before + d, total, rate)) if progress else None
        smoke_here = answers if k == trained_k else None
        res = _serve(verifier, cfg, runs, step, draft=draft, method=method, k=k, answers=smoke_here)
        done += len(runs)
        load_seconds[k] = res["load_seconds"]
        if smoke_here:
            joins = {"ends": answers["ends"], "max_tokens": answers["max_tokens"]}  # smoke.join_phases
            (out / SMOKE_ANSWERS_FILE).write_text(json.dumps(res["answers"] | joins))
        if k not in ks:
            continue
        rows += [_level_row(k, c, res["runs"][f"level/{c}"]) for c in lv]
        if k == suite_k:
            per_group = {n: res["runs"][n] for n in plan["groups"]}
    rows = with_speedup(rows, verifier_alone["levels"])
    groups = []
    for name, g in plan["groups"].items():
        r = per_group[name]
        mismatched = sum(1 for d, t in zip(g["digests"], r.get("texts", [])) if verifier_alone["texts"].get(d) != t)
        groups.append({"suite": g["suite"], "category": g["category"], "prompts": len(g["digests"]),
                       "lossless": mismatched == 0, "mismatched": mismatched, **_acceptance([r])})
    per_suite = []
    for s in suites:
        gs = [g for g in groups if g["suite"] == s.name]
        runs = [per_group[n] for n, g in plan["groups"].items() if g["suite"] == s.name]
        acc = _acceptance(runs)
        per_suite.append({"suite": s.name, "source": s.source, "prompts": sum(g["prompts"] for g in gs),
                          "left_out": excluded[s.name], "lossless": all(g["lossless"] for g in gs), **acc,
                          "acceptance_by_k": acceptance_by_k(acc["per_position"])})
    result = {"method": method, "trained_k": trained_k, "suite_k": suite_k, "k": ks, "levels": lv,
              "suites": per_suite, "categories": groups, "sweep": rows, "verifier_alone": verifier_alone["levels"],
              "load_seconds": load_seconds, "engine_loads": len(server_ks), "smoke_answered": bool(answers),
              "machine": machine_kind(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    result |= payoff(rows, draft, method, cfg.eval.target_concurrency)
    (out / EVALUATION_FILE).write_text(json.dumps(result, indent=1))
    return result


def evaluate_for_run(verifier: str, draft: str, verifier_alone_dir: str | Path, method: str, trained_k: int, cfg,
                     out: Path, left_out: set[str], data_dir: str | Path, smoke_baseline_dir: str | Path,
                     progress=None) -> dict:
    """The run's evaluation: the draft against the kept verifier-alone artifact, with the run's smoke test answered
    by its trained k's server (method and k are the draft architecture's, DraftArchitecture.method and .k; the
    smoke baseline splits reasoning from the final answer)."""
    return evaluate_draft(verifier, draft, method, trained_k, cfg, read_verifier_alone(verifier_alone_dir), out,
                          left_out, progress, answers_job(verifier, data_dir, smoke_baseline_dir, cfg))


def with_speedup(rows: list[dict], alone: list[dict]) -> list[dict]:
    """The sweep's rows with their speedup: output tokens/s with the draft over the verifier alone's at that level."""
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in alone}
    return [r | {"speedup": r["output_tokens_per_s"] / base[r["concurrency"]] if base.get(r["concurrency"]) else None}
            for r in rows]


def payoff(rows: list[dict], draft: str, method: str, target: int | None) -> dict:
    """From the sweep's rows (with_speedup): the best k per level, the crossover (the lowest level from which no k
    pays any more) and the speculative_config to serve at the target (else the lowest level)."""
    best = {}
    for c in sorted({r["concurrency"] for r in rows}):
        at = [r for r in rows if r["concurrency"] == c and r["speedup"] is not None]
        if at:
            top = max(at, key=lambda r: r["speedup"])
            best[c] = {"k": top["k"], "speedup": top["speedup"]}
    paying = [c for c, b in best.items() if b["speedup"] >= 1.0]
    crossover = next((c for c in sorted(best) if all(best[d]["speedup"] < 1.0 for d in best if d >= c)), None)
    serve_at = target if target in best else min(best, default=None)
    k_serve = best[serve_at]["k"] if serve_at is not None else None
    return {"best": {str(c): b for c, b in best.items()}, "pays_at": paying, "crossover": crossover,
            "serve_at": serve_at, "speculative_config": {"method": method, "model": draft,
                                                         "num_speculative_tokens": k_serve}}


def speedup_failure(evaluation: dict | None, target: int | None, min_speedup: float) -> str | None:
    """Why a draft fails the serving gate at the target concurrency, in one sentence (None: it passes, or no target)."""
    if evaluation is None or target is None:
        return None
    b = evaluation["best"].get(str(target))
    if b is None:
        return f"eval.target_concurrency={target} was not measured"
    if b["speedup"] < min_speedup:
        return (f"at the target concurrency {target} the draft's best output throughput (k={b['k']}) is "
                f"{b['speedup']:.2f}x the verifier alone's, below smoke.min_speedup={min_speedup}")
    return None


def payoff_sentence(evaluation: dict) -> str:
    """Where the draft pays on this host, in one sentence for the report."""
    best, host = evaluation["best"], evaluation["machine"]["gpus"] or evaluation["machine"]["cpu"]
    pays = evaluation["pays_at"]
    if not pays:
        return f"on {host} the draft is slower than the verifier alone at every concurrency measured " \
               f"({', '.join(best)})"
    loses = [c for c in best if int(c) not in pays]
    tail = f"; it costs at {', '.join(loses)}" if loses else ""
    return (f"on {host} the draft pays at concurrency {', '.join(map(str, pays))} (best "
            + ", ".join(f"{best[str(c)]['speedup']:.2f}x at k={best[str(c)]['k']}" for c in pays) + ")" + tail)


def compare(evaluations: dict[str, dict]) -> dict:
    """Drafts measured on the same suites, levels and verifier-alone figures, side by side: one row per draft."""
    rows = []
    for name, e in evaluations.items():
        row = {"draft": name, "method": e["method"], "k_measured": e["k"],
               "lossless": all(s["lossless"] for s in e["suites"])}
        row |= {f"acceptance {s['suite']}": round(s["mean_acceptance_length"], 3) for s in e["suites"]}
        row |= {f"speedup c={c}": f"{b['speedup']:.2f}x (k={b['k']})" for c, b in e["best"].items()}
        row["crossover"] = e["crossover"]
        rows.append(row)
    return {"rows": rows, "levels": next(iter(evaluations.values()))["levels"] if evaluations else []}


def comparison_markdown(table: dict, verifier: str, machine: dict) -> str:
    rows = table["rows"]
    if not rows:
        return ""
    cols = list(rows[0])
    host = machine.get("gpus") or machine.get("cpu")
    lines = [f"# eaglet eval: {len(rows)} drafts, verifier `{verifier}`, on {host}", "",
             "Acceptance: mean acceptance length (vLLM's counters) on each suite at the draft's largest k measured; "
             "speedup: output tokens/s with the draft over the verifier alone at each concurrency, at the best k; "
             "crossover: the lowest concurrency from which no k pays.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"
