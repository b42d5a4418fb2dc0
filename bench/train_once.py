"""One training run in a fresh process, timed: `python -m bench.train_once direct|pipeline SPEC.json`.

Both sides start alike (a new interpreter, nothing warm) and time only the training call; prints one JSON line
with "seconds" and the step clock's events (bench.steps), from which the runner takes the steady-state rate and
the start-up seconds.
  direct:   speculators' own entry point (`speculators.train.cli.main` on its `TrainConfig`), nothing of eaglet
            around it except, on CPU, the accelerator calls it cannot run without (`eaglet.train.cpu_patches`).
  pipeline: eaglet's `train-draft` Prefect task in a flow (fresh store, so it builds): speculators plus
            everything eaglet adds (float32 epoch checkpoints, metrics to the log and progress artifacts,
            the final bf16 draft, the artifact manifest with every file's sha256).
The step clock wraps the same speculators methods on both sides (timing only; nothing is replaced).
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    mode, spec = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    from bench.steps import StepClock

    clock = StepClock()
    if mode == "direct":
        import speculators.train.cli as cli
        from speculators.train.config import TrainConfig

        from eaglet.verifier.devices import on_accelerator
        from eaglet.train.cpu import cpu_patches

        clock.install()
        cfg = TrainConfig.resolve(spec["argv"])
        t0 = time.perf_counter()
        with contextlib.nullcontext() if on_accelerator() else cpu_patches():
            cli.main(cfg)  # through the module: the clock's wrapper
        t1 = time.perf_counter()
    else:
        os.environ["EAGLET_HOME"] = spec["store"]
        import speculators.train.cli  # noqa: F401  imported before the clock starts, as on the direct side
        from prefect import flow

        import eaglet.train.draft  # noqa: F401

        from eaglet.config import RunConfig
        from eaglet.verifier import VerifierInfo
        from tasks import stages

        clock.install(pipeline=True)

        @flow(name="bench-train-pipeline")
        def once() -> tuple[float, float]:
            info, cfg = VerifierInfo.model_validate(spec["verifier"]), RunConfig.model_validate(spec["cfg"])
            t0 = time.perf_counter()
            stages.train_draft.with_options(refresh_cache=True)(info, spec["states"], spec["vocab"], None,  # scratch
                                                                spec["data"], cfg)
            return t0, time.perf_counter()

        t0, t1 = once()
    print(json.dumps({"seconds": t1 - t0, "t0": t0, "t1": t1, "pipeline": mode == "pipeline", "events": clock.events}))
