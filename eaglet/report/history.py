"""A run directory's draft history, its quality gate and its promotion step.

  DIR/drafts/<draft key>/   every run's flat draft (hard links to DIR/draft's files) with its report.json
  DIR/current               a symlink to the drafts/<key> that serves: moved (atomically) only to a draft that
                            passes the gate and beats the current one on the same held-out prompts and settings
                            (a figure measured on other prompts or settings never decides a promotion)

The gate: a draft that is not lossless, or (smoke.min_acceptance) whose mean acceptance length is below the bar,
fails the run after its report is written; it is kept in the history, never promoted.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from eaglet.config import DraftParams
from eaglet.store import digest, link_or_copy, publish_dir

# a report from before runs recorded their architecture was of the config's default one
DEFAULT_ARCHITECTURE = DraftParams().architecture

DRAFTS, CURRENT = "drafts", "current"


def comparison_key(verifier_fingerprint: str, prompts: list[str], k: int, max_tokens: int, dtype: str) -> str:
    """Two acceptance figures compare only when they come from the same verifier, prompts and settings."""
    return digest({"verifier": verifier_fingerprint, "prompts": prompts, "k": k, "max_tokens": max_tokens,
                   "dtype": dtype})


def gate_failure(smoke: dict | None, min_acceptance: float | None) -> str | None:
    """Why the draft fails the quality gate, in one sentence (None: it passes, or there is no smoke test)."""
    if smoke is None:
        return None
    if not smoke["lossless"]:
        return (f"the draft is not lossless: greedy outputs with it differ from the verifier's alone on "
                f"{smoke.get('mismatched_prompts', 'some')} held-out prompts")
    mal = smoke["mean_acceptance_length"]
    if min_acceptance is not None and mal < min_acceptance:
        return f"mean acceptance length {mal:.3f} is below smoke.min_acceptance={min_acceptance}"
    return None


def current(out: Path) -> dict | None:
    """The serving draft's key and figures, from its kept report (None: nothing promoted yet)."""
    link = out / CURRENT
    report = link / "report.json"
    if not link.is_symlink() or not report.is_file():
        return None
    r = json.loads(report.read_text())
    smoke = r.get("smoke") or {}
    return {"key": link.resolve().name, "acceptance": smoke.get("mean_acceptance_length"),
            "comparison": r.get("comparison"), "lossless": smoke.get("lossless")}


def decide(out: Path, draft_key: str, smoke: dict | None, comparison: str | None, failure: str | None) -> dict:
    """Whether this run's draft becomes DIR/current, and why (the report says which won and by how much)."""
    cur = current(out)
    new = smoke["mean_acceptance_length"] if smoke else None
    d = {"promoted": False, "current_before": cur, "acceptance": new, "delta": None}
    if cur and cur["acceptance"] is not None and new is not None and cur["comparison"] == comparison:
        d["delta"] = round(new - cur["acceptance"], 4)
    if failure:
        d["reason"] = f"not promoted: {failure}"
    elif smoke is None:
        d["reason"] = "not promoted: no smoke test, so nothing to compare (smoke.enabled=false)"
    elif cur is None:
        d.update(promoted=True, reason="promoted: the first draft of this directory")
    elif cur["key"] == draft_key:
        d.update(promoted=True, reason="already current (the same draft)")
    elif cur["comparison"] != comparison:  # never promote on a figure that does not compare
        d["reason"] = (f"not promoted: the current draft {cur['key']} was measured on other held-out prompts, smoke "
                       "settings or verifier, so the two figures do not compare; the current draft stays (measure "
                       "it on these prompts with `eaglet smoke`, or use a new output directory)")
    elif d["delta"] > 0:
        d.update(promoted=True, reason=f"promoted: beats the current draft {cur['key']} by {d['delta']:+.3f} "
                 f"({new:.3f} vs {cur['acceptance']:.3f})")
    else:
        d["reason"] = (f"not promoted: does not beat the current draft {cur['key']} ({new:.3f} vs "
                       f"{cur['acceptance']:.3f}, {d['delta']:+.3f})")
    return d


def keep(out: Path, draft_key: str, promoted: bool) -> Path:
    """DIR/drafts/<key> from DIR/draft and DIR/report.json (hard links where possible), then DIR/current. A draft
    already kept keeps the report of the run that made it (a cached rerun's report says what it loaded, 0)."""
    def build(tmp: Path) -> None:
        for src in [*sorted((out / "draft").iterdir()), out / "report.json"]:
            link_or_copy(src, tmp / src.name)

    kept = out / DRAFTS / draft_key
    if not (kept / "report.json").is_file():
        publish_dir(build, kept)
    if promoted:
        tmp = out / f".{CURRENT}-{uuid.uuid4().hex[:8]}"
        os.symlink(Path(DRAFTS) / draft_key, tmp)
        os.replace(tmp, out / CURRENT)  # atomic: a reader sees the old draft or the new one
    return kept


def history(out: Path) -> list[dict]:
    """Every kept draft, oldest first: when, key, architecture and k, acceptance per position, lossless, rows,
    current or not. Drafts of either architecture measured at the same k on the same prompts compare (and one may
    replace the other as current: the draft's config tells vLLM its method)."""
    cur = (out / CURRENT).resolve().name if (out / CURRENT).is_symlink() else None
    rows = []
    for report in (out / DRAFTS).glob("*/report.json") if (out / DRAFTS).is_dir() else []:
        r = json.loads(report.read_text())
        smoke = r.get("smoke") or {}
        rows.append({
            "finished": r.get("finished") or report.stat().st_mtime,
            "draft": report.parent.name,
            "architecture": smoke.get("method")
            or (r.get("params") or {}).get("draft", {}).get("architecture", DEFAULT_ARCHITECTURE),
            "k": smoke.get("num_speculative_tokens"),
            "acceptance": smoke.get("mean_acceptance_length"),
            "per_position": smoke.get("acceptance_per_position"),
            "lossless": smoke.get("lossless"),
            "training_rows": (r.get("extraction") or {}).get("rows"),
            "init": (r.get("warm_start") or {}).get("from"),
            "current": report.parent.name == cur,
        })
    return sorted(rows, key=lambda x: x["finished"])


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def history_table(out: Path) -> list[dict]:
    """history() as the rows of a table (the Prefect UI's draft-history artifact)."""
    return [{"finished": when(h["finished"]), "draft": h["draft"], "architecture": h["architecture"], "k": h["k"],
             "mean acceptance": round(h["acceptance"], 4) if h["acceptance"] is not None else None,
             "per position": ", ".join(f"{a:.3f}" for a in h["per_position"] or []), "lossless": h["lossless"],
             "rows": h["training_rows"], "warm start": "yes" if h["init"] else "no",
             "current": "yes" if h["current"] else ""} for h in history(out)]
