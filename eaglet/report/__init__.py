"""The run's user-facing outputs: DIR/draft, DIR/draft-speculators, DIR/report.json, DIR/report.md."""

from __future__ import annotations

import base64
import json
import re
import shutil
import time
from pathlib import Path

from eaglet.capture.fleet import describe_shares
from eaglet.config import RunConfig
from eaglet.data import prompt_digests
from eaglet.drafts import registry
from eaglet.report import history
from eaglet.report.history import DEFAULT_ARCHITECTURE, when
from eaglet.report.plots import acceptance_history, acceptance_per_position, serving_payoff, training_curves
from eaglet.evaluate import serving
from eaglet.evaluate.smoke import read_baseline
from eaglet.store import LAST_USED, MANIFEST, publish_dir
from eaglet.train.checkpoints import read_delivered
from eaglet.train.lineage import read_lineage
from eaglet.train.metrics import read_metrics
from eaglet.verifier import VerifierInfo


def _copy_artifact(src: Path, skip: tuple[str, ...] = ()):
    def build(tmp: Path) -> None:
        for p in src.iterdir():
            if p.is_file() and p.name not in (MANIFEST, LAST_USED) and p.name not in skip:
                shutil.copy2(p, tmp / p.name)
    return build


def _stats(path: str) -> dict:
    f = Path(path) / "stats.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _leaves(cfg: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_difference(nested: dict, flat: dict) -> list[dict]:
    """Each key of the flat config (what vLLM reads) beside where speculators' nested config has it: the same
    key at some depth (`path`), or nowhere (derived by the converter from the weights or the verifier)."""
    by_leaf: dict[str, list[tuple[str, object]]] = {}
    for path, value in _leaves(nested).items():
        by_leaf.setdefault(path.rsplit(".", 1)[-1], []).append((path, value))
    rows = []
    for key, value in flat.items():
        if isinstance(value, dict):
            continue
        found = by_leaf.get(key, [])
        same = [p for p, v in found if v == value]
        if same:
            rows.append({"key": key, "flat": value, "nested_path": same[0], "nested": value, "change": "moved"
                         if same[0] != key else "same"})
        elif found:
            rows.append({"key": key, "flat": value, "nested_path": found[0][0], "nested": found[0][1],
                         "change": "changed"})
        else:
            rows.append({"key": key, "flat": value, "nested_path": None, "nested": None, "change": "added"})
    sources = {r["nested_path"].split(".")[0] for r in rows if r["nested_path"]}
    for key, value in nested.items():
        if key not in flat and key not in sources:
            rows.append({"key": None, "flat": None, "nested_path": key, "nested": value, "change": "dropped"})
    return rows


def _short(v: object) -> str:
    text = json.dumps(v)
    return text if len(text) <= 48 else text[:45] + "..."


def _engine_shares(shares: list[dict]) -> list[str]:
    """The data pass's engines, when it had several: each one's rows and speed, and any taken out (and why)."""
    return ["- capture engines: " + describe_shares(shares)] if len(shares) > 1 else []


def _states_line(report: dict) -> list[str]:
    """Where training's hidden states came from: bytes kept on disk, samples streamed, and the verifier forward
    passes per sample (a kept sample's states are computed once; a streamed one's each time training reads it)."""
    x = report.get("extraction") or {}
    if "samples_streamed" not in x:
        return []
    line = (f"- hidden states ({x['states']}): {x['bytes_linked'] / 1e9:.3g} GB on disk for "
            f"{x['samples'] - x['samples_streamed']} samples ({x['bytes_kept'] / 1e9:.3g} GB stored by this run), "
            f"{x['samples_streamed']} samples streamed")
    s = report.get("streamed") or {}
    if x["samples_streamed"] and s.get("engine_requests") is not None:
        line += (f"; training asked the verifier for {s['engine_requests']} forward passes, "
                 f"{s['engine_requests'] / x['samples_streamed']:.2f} per streamed sample over {s['epochs']} epochs "
                 "(validation samples every epoch, and the simulated decoding), against 1 per kept sample")
    return [line]


def _acc(value: float | None) -> str:
    return f"**{value:.3f}**" if value is not None else "nothing drafted"


def _answer_lines(report: dict) -> list[str]:
    """What the verifier's answers hold (reasoning, turns) and what training's step does to the longest samples."""
    x, p = report.get("extraction") or {}, report["params"]
    if not x.get("answer_tokens"):
        return []
    lines = []
    if x.get("reasoning_tokens") is not None:
        share = x["reasoning_tokens"] / x["answer_tokens"]
        lines.append(f"- reasoning: {share:.1%} of the verifier's {x['answer_tokens']} answer tokens are in reasoning "
                     f"blocks ({' '.join(p['data']['reasoning_tags'])}); "
                     + ("in the loss" if x.get("reasoning_in_loss", True) else "left out of the loss "
                        "(data.reasoning_in_loss=false)"))
    if x.get("turns") == "all":
        lines.append(f"- every assistant turn answered by the verifier (data.regenerate_turns=all): {x['samples']} "
                     f"samples, one per answered turn")
    if x.get("longest_sample"):
        step = p["training"]["total_seq_len"]
        lines.append(f"- longest sample {x['longest_sample']} tokens; {x.get('samples_at_max_seq_len', 0)} cut at "
                     f"data.max_seq_len at capture; speculators truncates a sample longer than training.total_seq_len "
                     f"({step}) to it: " + ("none here" if x["longest_sample"] <= step else "some here, raise it"))
    return lines


def render_markdown(report: dict) -> str:
    v = report["verifier"]
    d = report.get("draft") or {"architecture": report["params"]["draft"].get("architecture", DEFAULT_ARCHITECTURE)}
    tasks = report["tasks"]
    cached = [n for n, t in tasks.items() if t["state"] == "Cached"]
    lines = [
        "# eaglet run report",
        "",
        f"- verifier: `{v['path']}` ({v['model_type']}, fingerprint `{v['fingerprint']}`, {v['num_layers']} layers, "
        f"hidden {v['hidden_size']}, aux ids {v['aux_layer_ids']})",
        f"- data: {report.get('data_summary') or report['artifacts']['data']}",
        *_engine_shares((report.get("extraction") or {}).get("engines") or []),
        *_states_line(report),
        *_answer_lines(report),
        f"- draft ({d['architecture']}, {d.get('served_form', 'what vLLM loads')}): `{report['draft_dir']}`",
        f"- speculators checkpoint: `{report['speculators_dir']}`",
        f"- verifier weight loads before training: {report['verifier_loads']}; engine loads by stage: "
        + ", ".join(f"{k} {v}" for k, v in report.get("engine_loads", {}).items())
        + "; seconds loading: " + (", ".join(f"{k} {v:.1f}" for k, v in report.get("load_seconds", {}).items())
                                   or "none"),
        f"- cache hits: {len(cached)} of {len(tasks)} tasks" + (f" ({', '.join(cached)})" if cached else ""),
        "",
        "## Tasks",
        "",
        "| task | state | seconds |",
        "|---|---|---:|",
    ]
    lines += [f"| {name} | {t['state']} | {t['seconds']:.1f} |" for name, t in tasks.items()]
    lines.append(f"| **total** | | **{sum(t['seconds'] for t in tasks.values()):.1f}** |")
    plots = report.get("plots") or {}
    if plots.get("training"):
        lines += ["", "## Training", "",
                  f"![training loss and accuracy per TTT step or block position]({plots['training']})"]
    s = report.get("smoke")
    if s:
        lines += [
            "",
            "## vLLM smoke test",
            "",
            f"- draft: {s.get('method', d['architecture'])}, k = {s['num_speculative_tokens']}, {s['num_prompts']} held-out "
            "prompts, greedy",
            f"- mean acceptance length: **{s['mean_acceptance_length']:.3f}** (1 + accepted / drafts; at most "
            f"{s['num_speculative_tokens'] + 1})",
            "- acceptance per position: " + ", ".join(f"{a:.3f}" for a in s["acceptance_per_position"]),
            *([f"- on reasoning (the verifier's reasoning blocks, {s['reasoning_share']:.1%} of its answer tokens): "
               + _acc(s.get("acceptance_reasoning")) + "; on the final answer (after the block): "
               + _acc(s.get("acceptance_answer"))] if s.get("reasoning_share") is not None else []),
            f"- speculators' validation, delivered epoch ({d.get('score_meaning', 'the architecture score')}): "
            + (f"{report['validation_acceptance']:.3f}" if report.get("validation_acceptance") else "not available"),
            "- simulated decoding on those validation rows (drafts start where the previous step ended; a token "
            "outside the draft vocabulary is rejected), what vLLM should measure: " + _decoding(report),
            f"- lossless (identical outputs with and without the draft): {s['lossless']}",
            f"- tokens/s without draft {s['tokens_per_s_without_draft']:.0f}, with draft "
            f"{s['tokens_per_s_with_draft']:.0f} (every prompt at once "
            + ("on the evaluation's vLLM server at this k" if s.get("engine") == "evaluation" else "in an offline engine")
            + ": the heaviest load; what the draft does at each concurrency is in the serving section)",
        ]
        if s.get("baseline_measured"):
            kept = (" (the kept baseline: the smoke test started no engine, the evaluation's server with the draft "
                    "answered it)" if s.get("engine") == "evaluation" else
                    " (the kept baseline: the smoke-load itself started one engine, the one with the draft)")
            lines.append(f"- verifier alone measured {s['baseline_measured']}" + (kept if s.get("baseline_reused") else ""))
        if plots.get("acceptance"):
            lines += ["", f"![acceptance per position]({plots['acceptance']})"]
    lines += _evaluation_lines(report.get("evaluation"), report.get("payoff"), plots, report["params"]["eval"])
    h, w = report.get("held_out"), report.get("warm_start")
    if h:
        seen = "not known" if h["seen_in_training"] is None else h["seen_in_training"]
        lines += ["", "## Held-out prompts", "", f"- {h['prompts']} held-out prompts; seen in training by this draft "
                  f"or a draft it was warm-started from: **{seen}**"]
        if w:
            lines.append(f"- training.init={w.get('requested')}: {w.get('reason')}")
    p = report.get("promotion")
    if p:
        lines += ["", "## Promotion", "", f"- {p['reason']}"]
        if report.get("gate_failure"):
            lines.append(f"- quality gate: **failed**: {report['gate_failure']}")
    hist = report.get("history") or []
    if hist:
        lines += ["", "## Draft history (this directory)", "",
                  "| finished | draft | architecture, k | mean acceptance | per position | lossless | rows | warm start "
                  "| current |", "|---|---|---|---:|---|---|---:|---|---|"]
        for h in hist:
            acc = f"{h['acceptance']:.3f}" if h["acceptance"] is not None else "-"
            per = ", ".join(f"{a:.3f}" for a in h["per_position"] or [])
            lines.append(f"| {when(h['finished'])} | `{h['draft']}` | {h['architecture']}, {h['k'] or '-'} | {acc} | "
                         f"{per} | {h['lossless']} | "
                         f"{h['training_rows'] or '-'} | {'yes' if h['init'] else 'no'} | "
                         f"{'**current**' if h['current'] else ''} |")
        if plots.get("history"):
            lines += ["", f"![mean acceptance length over the draft history]({plots['history']})"]
    diff = report.get("config_difference")
    if diff:
        moved = [r["key"] for r in diff if r["change"] == "moved"]
        same = [r["key"] for r in diff if r["change"] == "same"]
        lines += [
            "",
            "## Config: speculators' nested form vs the flat form vLLM loads",
            "",
            f"- {len(moved)} keys moved unchanged from the nested `transformer_layer_config` (or deeper) to the "
            f"top level; {len(same)} kept their place and value.",
            "",
            "| flat key | flat value | nested key | nested value |",
            "|---|---|---|---|",
        ]
        for r in diff:
            if r["change"] == "changed":
                lines.append(f"| `{r['key']}` | `{_short(r['flat'])}` | `{r['nested_path']}` | `{_short(r['nested'])}` |")
            elif r["change"] == "added":
                lines.append(f"| `{r['key']}` | `{_short(r['flat'])}` | (added by the converter) | |")
            elif r["change"] == "dropped":
                lines.append(f"| (not in the flat form) | | `{r['nested_path']}` | `{_short(r['nested'])}` |")
    return "\n".join(lines) + "\n"


def _evaluation_lines(e: dict | None, payoff: str | None, plots: dict, params: dict) -> list[str]:
    """Is it worth serving: acceptance per suite and category, the concurrency sweep per k, the k to serve."""
    if not e:
        return []
    def f(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    lines = ["", "## Is it worth serving (vLLM's serving benchmark)", "", f"- **{payoff}**",
             f"- measured {e['measured_at']}: greedy, {params['max_tokens']} tokens per request, one server per k "
             f"measured (k = {', '.join(map(str, e['k']))}: {e['engine_loads']} draft loads; eval.k measures others), "
             "the verifier alone kept from its own run",
             "", "| suite | prompts | left out (trained on) | mean acceptance | per position | lossless |",
             "|---|---:|---:|---:|---|---|"]
    for s in e["suites"]:
        lines.append(f"| {s['suite']} | {s['prompts']} | {s['left_out']} | {s['mean_acceptance_length']:.3f} | "
                     + ", ".join(f"{a:.2f}" for a in s["per_position"]) + f" | {s['lossless']} |")
    by_k = [s for s in e["suites"] if len(s.get("acceptance_by_k") or []) > 1]
    if by_k:
        lines += ["", "Mean acceptance at each shorter chain, read from the per-position rates above: " + "; ".join(
            f"{s['suite']} " + ", ".join(f"k={j} {a:.2f}" for j, a in enumerate(s["acceptance_by_k"], 1))
            for s in by_k)]
    lines += ["", f"Per category (k = {e.get('suite_k', e['trained_k'])}):", "", "| suite | category | prompts | mean acceptance | "
              "per position | lossless |", "|---|---|---:|---:|---|---|"]
    for c in e["categories"]:
        lines.append(f"| {c['suite']} | {c['category']} | {c['prompts']} | {c['mean_acceptance_length']:.3f} | "
                     + ", ".join(f"{a:.2f}" for a in c["per_position"])
                     + f" | {c['lossless']}" + (f" ({c['mismatched']} differ)" if c["mismatched"] else "") + " |")
    lines += ["", "| concurrency | k | output tokens/s | speedup | acceptance | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
              "|---:|---:|---:|---:|---:|---|---|"]
    for r in sorted(e["verifier_alone"] + e["sweep"], key=lambda r: (r["concurrency"], r["k"])):
        lines.append(f"| {r['concurrency']} | {r['k'] or 'alone'} | {f(r['output_tokens_per_s'])} | "
                     f"{f(r.get('speedup'), '.2f')} | {f(r.get('acceptance_length'), '.2f')} | "
                     f"{f(r.get('ttft_ms_p50'))} / {f(r.get('ttft_ms_p99'))} | {f(r.get('tpot_ms_p50'), '.1f')} / "
                     f"{f(r.get('tpot_ms_p99'), '.1f')} |")
    lines += ["", "- best k per concurrency: " + ", ".join(f"{c}: k={b['k']} ({b['speedup']:.2f}x)"
                                                          for c, b in e["best"].items()),
              "- crossover: " + (f"from concurrency {e['crossover']} no k pays" if e["crossover"] else
                                  "none within the levels measured"),
              f"- to serve at concurrency {e['serve_at']}: `--speculative-config "
              f"'{json.dumps(e['speculative_config'])}'`"]
    if plots.get("serving"):
        lines += ["", f"![output throughput and speedup per concurrency and k]({plots['serving']})"]
    return lines


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _decoding(report: dict) -> str:
    d = report.get("simulated_decoding")
    if not d:
        return "not available"
    return (f"**{d['chain_in_vocab']:.3f}** (" + ", ".join(f"{a:.3f}" for a in d["chain_in_vocab_per_position"])
            + f"; {d['rows']} rows, k = {d['ttt_steps']})")


def validation_acceptance(checkpoint: Path, arch: registry.DraftArchitecture) -> float | None:
    """The acceptance length the delivered epoch's validation metrics predict (the architecture's score), from the
    metrics eaglet recorded while training (speculators does not always save val_metrics.json)."""
    delivered = read_delivered(checkpoint)  # the delivered epoch and its figure (eaglet.train.best_checkpoint)
    if delivered:
        return delivered["predicted"]
    val = [r for r in read_metrics(checkpoint) if r["kind"] == "val"]  # older drafts: the last epoch's
    last = max(reversed(val), key=lambda r: r["epoch"] or 0) if val else None  # a resumed run repeats rows: the last
    return arch.score(last["metrics"]) if last else None


def make_plots(out: Path, checkpoint_dir: str, smoke: dict | None, evaluation: dict | None = None) -> dict[str, str]:
    """PNG files beside the report; returns their names (the report links them relatively)."""
    plots = {}
    if training_curves(read_metrics(Path(checkpoint_dir)), out / "training.png"):
        plots["training"] = "training.png"
    if smoke:
        acceptance_per_position(smoke["acceptance_per_position"], smoke["mean_acceptance_length"],
                                smoke["num_speculative_tokens"], out / "acceptance.png")
        plots["acceptance"] = "acceptance.png"
    if evaluation and serving_payoff(evaluation, out / "serving.png"):
        plots["serving"] = "serving.png"
    return plots


def load_seconds(tasks: dict, stats: dict[str, dict], smoke: dict | None) -> dict[str, float]:
    """Seconds each task that loaded verifier weights spent loading them (the rest of its time was work)."""
    out = {}
    if "load-verifier" in tasks and tasks["load-verifier"]["state"] != "Cached":
        out["load-verifier"] = tasks["load-verifier"]["seconds"]
    for task, kind in (("regenerate-responses", "regeneration"), ("extract-hidden-states", "extraction")):
        if task in tasks and tasks[task]["state"] != "Cached" and stats.get(kind, {}).get("load_seconds"):
            out[task] = round(stats[kind]["load_seconds"], 2)
    if "verifier-baseline" in tasks and tasks["verifier-baseline"]["state"] != "Cached" and stats.get("baseline"):
        out["verifier-baseline"] = round(stats["baseline"]["load_seconds"], 2)
    if smoke and tasks.get("smoke-test", {}).get("state") != "Cached" and smoke.get("engine") != "evaluation":
        out["smoke-test"] = round(smoke["load_seconds_without_draft"] + smoke["load_seconds_with_draft"], 2)
    return out


def write_outputs(out: Path, params: RunConfig, verifier: VerifierInfo, tasks: dict, artifacts: dict[str, str],
                  verifier_loads: int, smoke: dict | None, engine_loads: dict[str, int] | None = None,
                  comparison: str | None = None, warm_start: dict | None = None) -> dict:
    """artifacts: store paths by stage (data, responses, hidden_states, vocab, checkpoint, draft).
    verifier_loads: weight loads before training; engine_loads: per stage, every load of the run.
    comparison: eaglet.report.history.comparison_key of the smoke test. Keeps the draft in DIR/drafts/<key> and moves
    DIR/current to it if it passes the gate and beats the current one (eaglet.report.history)."""
    out = out.resolve()
    arch = registry.get(params.draft.architecture)
    draft_key = Path(artifacts["draft"]).name
    evaluation = _json(Path(artifacts["evaluation"]) / serving.EVALUATION_FILE) if "evaluation" in artifacts else None
    failure = history.gate_failure(smoke, params.smoke.min_acceptance) or serving.speedup_failure(
        evaluation, params.eval.target_concurrency, params.smoke.min_speedup)
    promotion = history.decide(out, draft_key, smoke, comparison, failure)
    draft = publish_dir(_copy_artifact(Path(artifacts["draft"])), out / "draft")
    spec = publish_dir(_copy_artifact(Path(artifacts["checkpoint"])), out / "draft-speculators")
    if evaluation:  # the k to serve, judged at this run's target and for this directory's draft
        evaluation |= serving.payoff(evaluation["sweep"], str(draft), evaluation["method"],
                                     params.eval.target_concurrency)
    report = {
        "verifier": verifier.model_dump(),
        "draft_dir": str(draft),
        "speculators_dir": str(spec),
        "artifacts": artifacts,
        "verifier_loads": verifier_loads,
        "engine_loads": engine_loads or {"data": verifier_loads},
        "tasks": {name: {"state": t["state"], "seconds": t["seconds"], "started": t["started"]}
                  for name, t in tasks.items()},
        "regeneration": _stats(artifacts["responses"]) if "responses" in artifacts else None,
        "extraction": _stats(artifacts["hidden_states"]),
        "vocab": _stats(artifacts["vocab"]),
        "params": params.model_dump(),
        "smoke": smoke,
        "comparison": comparison,
        "gate_failure": failure,
        "promotion": promotion,
        "warm_start": warm_start,
        "held_out": held_out_overlap(Path(artifacts["data"]), Path(artifacts["checkpoint"]),
                                     (warm_start or {}).get("from")),
        "draft": {"architecture": arch.name, "served_form": arch.served_form, "score_meaning": arch.score_meaning},
        "validation_acceptance": validation_acceptance(Path(artifacts["checkpoint"]), arch),
        "simulated_decoding": _json(Path(artifacts["checkpoint"]) / "acceptance.json"),
        "streamed": _json(Path(artifacts["checkpoint"]) / "streamed.json"),
        "finished": time.time(),
        "config_difference": config_difference(json.loads((spec / "config.json").read_text()),
                                               json.loads((draft / "config.json").read_text())),
        "plots": make_plots(out, artifacts["checkpoint"], smoke, evaluation),
        "evaluation": evaluation,
        "payoff": serving.payoff_sentence(evaluation) if evaluation else None,
    }
    baseline = {}
    if "baseline" in artifacts:
        baseline = {k: v for k, v in read_baseline(artifacts["baseline"]).items() if k != "token_ids"}
    report["baseline"] = baseline or None
    report["load_seconds"] = load_seconds(report["tasks"], {"regeneration": report["regeneration"] or {},
                                                            "extraction": report["extraction"] or {},
                                                            "baseline": baseline}, smoke)
    lines = {n: sum(1 for _ in open(Path(artifacts["data"]) / f"{n}.jsonl")) for n in ("train", "eval")}
    report["data_summary"] = f"{lines['train']} training and {lines['eval']} held-out conversations"
    rows = report["extraction"]
    if rows.get("rows") is not None:
        report["data_summary"] += (f"; {rows['rows']} rows captured: {rows['rows_computed']} computed by this run, "
                                   f"{rows['rows_reused']} reused")
    _write_json(out / "report.json", report)
    history.keep(out, draft_key, promotion["promoted"])  # keeps this report.json (a hard link) beside the draft
    report["history"] = history.history(out)
    if len(report["history"]) > 1 and make_history_plot(out, report["history"]):
        report["plots"]["history"] = "history.png"
    _write_json(out / "report.json", report)  # a new file: the kept link still holds the run's own report
    (out / "report.md").write_text(render_markdown(report))
    return report


def held_out_overlap(data_dir: Path, checkpoint: Path, warm_from: str | None) -> dict:
    """How many of the run's held-out prompts the delivered draft, or any draft it was warm-started from, trained
    on (0 unless a rule broke; None: not known, a warm start from a directory with no eaglet lineage)."""
    held = prompt_digests(data_dir / "eval.jsonl")
    lineage = read_lineage(checkpoint)
    if lineage is None:  # a draft trained before lineages were kept: its own rows, and its warm start's record
        parent = read_lineage(Path(warm_from)) if warm_from else {"known": True, "prompts": []}
        lineage = {"known": bool(parent and parent["known"]),
                   "prompts": prompt_digests(data_dir / "train.jsonl") | set((parent or {}).get("prompts", []))}
    seen = len(held & set(lineage["prompts"])) if lineage["known"] else None
    return {"prompts": len(held), "seen_in_training": seen}


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def make_history_plot(out: Path, rows: list[dict]) -> bool:
    return acceptance_history(rows, out / "history.png") is not None


def inline_images(markdown: str, out: Path) -> str:
    """The UI cannot read files on the worker's disk: a PNG the report links becomes a data URI."""
    def inline(m: re.Match) -> str:
        png = out / m.group(2)
        if not png.is_file():
            return m.group(0)
        return f"![{m.group(1)}](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})"
    return re.sub(r"!\[([^\]]*)\]\(([^):]+\.png)\)", inline, markdown)


def acceptance_table(smoke: dict) -> list[dict]:
    """The smoke test's acceptance per position as table rows (the UI's acceptance-per-position)."""
    return [{"position": i + 1, "acceptance": round(a, 4), "accepted": round(a * smoke["drafts"]),
             "drafts": smoke["drafts"]} for i, a in enumerate(smoke["acceptance_per_position"])]


def ui_tables(report: dict, out: Path) -> dict[str, tuple[list[dict], str]]:
    """The report's tables for the Prefect UI: key -> (rows, description)."""
    tables = {}
    smoke = report.get("smoke")
    if smoke:
        tables["acceptance-per-position"] = (acceptance_table(smoke), (
            f"vLLM, k={smoke['num_speculative_tokens']}, {smoke['num_prompts']} held-out prompts: mean acceptance "
            f"length {smoke['mean_acceptance_length']:.3f}"))
    tables |= evaluation_tables(report)
    hist = history.history_table(out)
    if hist:
        tables["draft-history"] = (hist, f"every draft kept in {out / 'drafts'}, oldest first; {out / 'current'} "
                                         f"serves: {(report.get('promotion') or {}).get('reason', '')}")
    return tables


def ui_links(report: dict, out: Path) -> dict[str, tuple[str, str, str]]:
    """The report's links for the Prefect UI: key -> (URI, link text, description): the draft, each plot."""
    links = {"flat-draft": (Path(report["draft_dir"]).as_uri(), report["draft_dir"],
                            (report.get("draft") or {}).get("served_form", "the draft vLLM loads"))}
    for name, file in (report.get("plots") or {}).items():
        links[f"plot-{name}"] = ((out / file).resolve().as_uri(), file, f"{name} plot (PNG, also inline in the report)")
    return links


def evaluation_tables(report: dict) -> dict[str, tuple[list[dict], str]]:
    """The UI's tables of the evaluation: key -> (rows, description)."""
    e = report.get("evaluation")
    if not e:
        return {}
    cats = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items() if k != "per_position"}
            for c in e["categories"]]
    sweep = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}
             for r in sorted(e["verifier_alone"] + e["sweep"], key=lambda r: (r["concurrency"], r["k"]))]
    return {"suite-acceptance": (cats, f"acceptance per suite and category at k={e.get('suite_k', e['trained_k'])} (vLLM's counters)"),
            "serving-sweep": (sweep, f"{report.get('payoff')}; k=0 is the verifier alone")}
