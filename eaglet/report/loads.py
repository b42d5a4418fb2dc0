"""What a run paid in weight loads, from its tasks' states: the unit users pay in (22.5 minutes each for a
Kimi-K2.5 verifier)."""

from __future__ import annotations

import json
from pathlib import Path

from eaglet.evaluate.serving import EVALUATION_FILE
from eaglet.store import built_by_this_process_since

HF_DATA_STAGES = ("regenerate-responses", "extract-hidden-states")  # each loads the verifier when it builds
SMOKE_STAGES = ("verifier-baseline", "smoke-test")  # one engine each, when it ran


def engine_loads(tasks: dict, endpoint: list[str] | None, started: float) -> dict[str, int]:
    """{"data": verifier loads before training, "smoke": engines the smoke stage started, "evaluation": servers
    the evaluation started (the verifier alone, and one per k)}. tasks: name ->
    {"state", "result"} as the flow recorded them; load-verifier's result is the engines it started (one load
    each); a served endpoint is no load of this run's."""
    data = len(tasks["load-verifier"]["result"]) if "load-verifier" in tasks and not endpoint else 0
    data += sum(1 for name in HF_DATA_STAGES
                if name in tasks and built_by_this_process_since(tasks[name]["result"], started))
    smoke = sum(1 for name in SMOKE_STAGES if name in tasks and tasks[name]["state"] != "Cached"
                and not (isinstance(tasks[name]["result"], dict) and tasks[name]["result"].get("engine") == "evaluation"))
    ran = {name for name in ("verifier-serving", "evaluate-draft") if tasks.get(name, {}).get("state") not in
           (None, "Cached")}
    evaluation = ("verifier-serving" in ran) + (json.loads((Path(tasks["evaluate-draft"]["result"]) /
                                                            EVALUATION_FILE).read_text())["engine_loads"]
                                                 if "evaluate-draft" in ran else 0)
    return {"data": data, "smoke": smoke, "evaluation": evaluation}


def loads_summary(loads: dict[str, int]) -> str:
    return f"verifier loads {loads['data']}, smoke engines {loads['smoke']}, evaluation servers {loads['evaluation']}"
