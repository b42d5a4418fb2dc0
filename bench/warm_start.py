"""Nightly retraining measured: warm-start variants against training from scratch on the same grown data
(docs/experiments.md, issue 38). `python -m bench.warm_start --home DIR --cold OUT [--sizes ...] [--variants ...]`.

DIR holds the store and Prefect home of a cold demo run whose output directory is OUT (`eaglet run --output-dir
OUT` with EAGLET_HOME=DIR/eaglet, PREFECT_HOME=DIR/prefect). Each (size, variant) is one `eaglet run` on a grown
copy of the demo's prompts, from a copy of OUT (so its promotion is judged against the cold draft alone), with no
data.eval_path: the grown file holds shipped prompts, so its held-out rows are the shipped data/eval.jsonl. Warm
variants start from the cold draft itself (training.init = its store directory), so every size and variant
continues the same draft. One line per run is appended to DIR/warm-start.jsonl: acceptance (mean and per position),
training seconds, rows computed, verifier loads, promotion.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data"

# Growth sizes: the demo's 960 prompts (920 trained on, 40 held out) plus new ones.
SIZES = {
    "+48": lambda: (DATA / "more-prompts.jsonl").read_text().splitlines(),
    "+25%": lambda: (DATA / "prompts-extra.jsonl").read_text().splitlines()[:230],
    "+100%": lambda: (DATA / "prompts-extra.jsonl").read_text().splitlines()[:920],
}
WARM = ["training.warm_epochs=1"]
VARIANTS = {
    "scratch": ["training.init=scratch"],
    "restart": WARM + ["training.warm_lr_fraction=1.0"],  # the nightly before issue 38: the full schedule again
    "low-lr": WARM + ["training.warm_lr_fraction=0.25", "training.warm_warmup_steps=0"],
    "replay": WARM + ["training.warm_lr_fraction=0.25", "training.warm_warmup_steps=0",
                      "training.warm_replay_fraction=0.25"],
}


def grown_file(home: Path, size: str) -> Path:
    path = home / f"prompts{size.replace('%', 'pct')}.jsonl"
    if not path.is_file():
        lines = (DATA / "prompts.jsonl").read_text().splitlines() + SIZES[size]()
        path.write_text("\n".join(lines) + "\n")
    return path


def run_one(home: Path, cold: Path, size: str, variant: str) -> dict:
    cold_report = json.loads((cold / "report.json").read_text())
    out = home / "runs" / f"{size.replace('%', 'pct')}-{variant}"
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(cold, out, symlinks=True)
    sets = [f"data.path={grown_file(home, size)}", *VARIANTS[variant]]
    if variant != "scratch":
        sets.append(f"training.init={cold_report['artifacts']['checkpoint']}")
    env = dict(os.environ, EAGLET_HOME=str(home / "eaglet"), PREFECT_HOME=str(home / "prefect"))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "run", *[f"--set={s}" for s in sets],
                           "--output-dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    (out / "run.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{size} {variant} failed (exit {proc.returncode}); see {out / 'run.log'}")
    r = json.loads((out / "report.json").read_text())
    smoke, train = r["smoke"], r["tasks"]["train-draft"]
    return {"size": size, "variant": variant, "sets": sets, "wall_s": round(time.time() - t0, 1),
            "train_s": train["seconds"], "train_state": train["state"],
            "training_rows": r["extraction"]["rows"], "rows_computed": r["extraction"]["rows_computed"],
            "verifier_loads": r["verifier_loads"], "acceptance": smoke["mean_acceptance_length"],
            "per_position": smoke["acceptance_per_position"], "lossless": smoke["lossless"],
            "cold_acceptance": cold_report["smoke"]["mean_acceptance_length"],
            "held_out_seen": r["held_out"], "warm_start": r["warm_start"], "promotion": r["promotion"],
            "simulated": (r.get("simulated_decoding") or {}).get("chain_in_vocab"), "finished": time.time()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", type=Path, required=True)
    ap.add_argument("--cold", type=Path, required=True)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    for size in args.sizes:
        for variant in args.variants:
            row = run_one(args.home, args.cold.resolve(), size, variant)
            with open(args.home / "warm-start.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{size:6} {variant:8} acceptance {row['acceptance']:.3f} (cold {row['cold_acceptance']:.3f}), "
                  f"training {row['train_s']:.0f} s, rows computed {row['rows_computed']}, "
                  f"{row['promotion']['reason']}", flush=True)


if __name__ == "__main__":
    main()
