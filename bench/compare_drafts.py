"""`python -m bench.compare_drafts --verifier V --prompts EVAL.jsonl DRAFT [DRAFT ...]`: the same held-out prompts
decoded by vLLM with each draft (any architecture: eaglet.drafts reads it from the draft's config), against the
verifier alone, batched and at batch 1 (bench.measure.decoding: both engines in one process, passes alternating).

Writes bench/results/<date>-<cpu>-<name>.{json,md}. Exit 1 if a draft's outputs differ from the verifier's alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from bench import measure
from bench.run import _cpu_model, _slug, _versions


def compare(verifier: str, prompts_file: str, drafts: list[str], k: int, num_prompts: int, max_tokens: int,
            batch1_prompts: int, repeats: int) -> dict:
    from eaglet.evaluate.smoke import load_prompts

    prompts = load_prompts(prompts_file, num_prompts)
    batch1 = {"ks": [k], "prompts": batch1_prompts, "max_tokens": max_tokens, "repeats": repeats, "warmup": 1}
    rows = []
    for draft in drafts:
        dec = measure.decoding(verifier, draft, prompts, [k], max_tokens, batch1, max_model_len=2048 + max_tokens,
                               batched_in_pair=True)
        rows.append({"draft": draft, **dec})
    return {"date": datetime.date.today().isoformat(), "cpu_model": _cpu_model(), "versions": _versions(),
            "verifier": verifier, "prompts": prompts_file, "k": k, "rows": rows}


def _sp(s: dict, fmt: str = ".1f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})" if s["n"] > 1 else f"{s['median']:{fmt}}"


def render(r: dict) -> str:
    lines = [f"# Drafts compared: {r['date']}, {r['cpu_model']}", "",
             f"verifier `{r['verifier']}`, prompts `{r['prompts']}`, k = {r['k']}, float32, greedy; "
             + ", ".join(f"{k} {v}" for k, v in r["versions"].items()), "",
             "| draft | method | batched: acceptance (per position) | batched tokens/s alone / draft | batch 1 "
             "tokens/s alone | batch 1 with draft | batch 1 speedup | batch 1 acceptance | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        b, [one] = row["k"][0], row["batch1"]["rows"]
        lines.append(
            f"| `{Path(row['draft']).name}` | {row['method']} | {b['mean_acceptance_length']:.3f} ("
            + ", ".join(f"{a:.3f}" for a in b["acceptance_per_position"]) + f") | "
            f"{row['baseline_tokens_per_s_batched']:.0f} / {b['tokens_per_s_batched']:.0f} | "
            f"{_sp(one['alone_tokens_per_s'])} | {_sp(one['draft_tokens_per_s'])} | {_sp(one['speedup'], '.2f')} | "
            f"{_sp(one['mean_acceptance_length'], '.3f')} | {b['identical_outputs'] and one['identical_outputs']} |")
    first = r["rows"][0]
    b1 = first["batch1"]
    lines += ["", f"Batched: {first['prompts']} prompts at once, {first['max_tokens']} tokens each. Batch 1: the first "
              f"{b1['prompts']} prompts one at a time, {b1['repeats']} passes alternating alone / draft on two warm "
              "engines in one process (median, min-max of the passes)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.compare_drafts", description=__doc__.split("\n")[0])
    ap.add_argument("drafts", nargs="*", help="draft directories (flat EAGLE-3 or DFlash)")
    ap.add_argument("--verifier")
    ap.add_argument("--prompts", help="held-out prompts (a run's data artifact eval.jsonl)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch1-prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="drafts")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--render", help="only render this results .json again (no vLLM)")
    args = ap.parse_args(argv)
    if args.render:
        text = render(json.loads(Path(args.render).read_text()))
        Path(args.render).with_suffix(".md").write_text(text)
        print(text)
        return 0
    r = compare(args.verifier, args.prompts, args.drafts, args.k, args.num_prompts, args.max_tokens,
                args.batch1_prompts, args.repeats)
    stem = Path(args.out) / f"{r['date']}-{_slug(r['cpu_model'])}-{args.name}"
    stem.with_suffix(".json").write_text(json.dumps(r, indent=2) + "\n")
    text = render(r)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0 if all(row["k"][0]["identical_outputs"] for row in r["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
