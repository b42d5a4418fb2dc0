"""The run's user-facing outputs: DIR/draft, DIR/draft-speculators, DIR/report.json, DIR/report.md."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eaglet.config import RunConfig
from eaglet.store import LAST_USED, MANIFEST, publish_dir
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


def render_markdown(report: dict) -> str:
    v = report["verifier"]
    lines = [
        "# eaglet run report",
        "",
        f"- verifier: `{v['path']}` (fingerprint `{v['fingerprint']}`, {v['num_layers']} layers, "
        f"aux ids {v['aux_layer_ids']})",
        f"- flat draft (vLLM): `{report['draft_dir']}`",
        f"- speculators checkpoint: `{report['speculators_dir']}`",
        f"- verifier weight loads in this run: {report['verifier_loads']}",
        "",
        "## Stages",
        "",
        "| task | state | seconds |",
        "|---|---|---:|",
    ]
    lines += [f"| {name} | {t['state']} | {t['seconds']:.1f} |" for name, t in report["tasks"].items()]
    s = report.get("smoke")
    if s:
        lines += [
            "",
            "## vLLM smoke test",
            "",
            f"- k = {s['num_speculative_tokens']}, {s['num_prompts']} held-out prompts, greedy",
            f"- mean acceptance length: **{s['mean_acceptance_length']:.3f}** (1 + accepted / drafts)",
            "- acceptance per position: " + ", ".join(f"{a:.3f}" for a in s["acceptance_per_position"]),
            f"- lossless (identical outputs with and without the draft): {s['lossless']}",
            f"- tokens/s without draft {s['tokens_per_s_without_draft']:.0f}, with draft "
            f"{s['tokens_per_s_with_draft']:.0f} (batched, vLLM)",
        ]
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, params: RunConfig, verifier: VerifierInfo, tasks: dict, artifacts: dict[str, str],
                  verifier_loads: int, smoke: dict | None) -> dict:
    """artifacts: store paths by stage (data, responses, hidden_states, vocab, checkpoint, draft)."""
    out = out.resolve()
    draft = publish_dir(_copy_artifact(Path(artifacts["draft"])), out / "draft")
    spec = publish_dir(_copy_artifact(Path(artifacts["checkpoint"])), out / "draft-speculators")
    report = {
        "verifier": verifier.model_dump(),
        "draft_dir": str(draft),
        "speculators_dir": str(spec),
        "artifacts": artifacts,
        "verifier_loads": verifier_loads,
        "tasks": {name: {"state": t["state"], "seconds": t["seconds"]} for name, t in tasks.items()},
        "regeneration": _stats(artifacts["responses"]) if "responses" in artifacts else None,
        "extraction": _stats(artifacts["hidden_states"]),
        "vocab": _stats(artifacts["vocab"]),
        "params": params.model_dump(),
        "smoke": smoke,
    }
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(out / "report.json")
    (out / "report.md").write_text(render_markdown(report))
    return report
