"""The training step clock: timestamps of speculators' own training steps, on both sides of the comparison.

`StepClock.install()` wraps (times, never replaces) speculators' Trainer methods in this process: each training
step's batch (its token count, read where speculators reads it: `document_ids != -1`) and its end, the epochs,
validation, checkpoint saves and `speculators.train.cli.main`; with `pipeline=True` also what eaglet adds around
it (`eaglet.train.train_draft`, `write_final_draft`, `eaglet.store.publish` and its build). `profile()` turns the
events into a steady-state tokens/s and start-up seconds, itemised.
"""

from __future__ import annotations

import functools
import time


class StepClock:
    def __init__(self) -> None:
        self.events: list[list] = []  # [name, start, end, extra]

    def _span(self, owner, attr: str, name: str, extra=None) -> None:
        orig = getattr(owner, attr)
        events = self.events

        @functools.wraps(orig)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                events.append([name, t, time.perf_counter(), extra(args) if extra else None])

        setattr(owner, attr, timed)

    def install(self, pipeline: bool = False) -> None:
        import speculators.train.cli as cli
        import speculators.train.recovery as recovery
        import speculators.train.trainer as trainer

        events = self.events
        consume = recovery.BatchRecoveryCoordinator.consume

        def counted(self_, batch, *args, **kwargs):
            if self_.phase == "training":
                ids = batch.get("document_ids")
                tokens = int((ids != -1).sum()) if ids is not None else int(batch["input_ids"].numel())
                events.append(["batch", time.perf_counter(), None, tokens])
            return consume(self_, batch, *args, **kwargs)

        recovery.BatchRecoveryCoordinator.consume = counted
        T = trainer.Trainer
        self._span(T, "_schedulers_step", "step")
        self._span(T, "train_epoch", "epoch")
        self._span(T, "val_epoch", "validation")
        self._span(T, "maybe_save_checkpoint", "checkpoint save")
        self._span(cli, "main", "speculators main")
        if pipeline:
            import eaglet.store as store
            import eaglet.train.draft as train  # the stage's own bindings of what it calls

            self._span(train, "train_draft", "eaglet train_draft")
            self._span(train, "write_final_draft", "final bf16 draft")
            publish = store.publish

            @functools.wraps(publish)
            def timed_publish(kind, key, build, *args, **kwargs):
                @functools.wraps(build)
                def timed_build(work):
                    t = time.perf_counter()
                    try:
                        return build(work)
                    finally:
                        events.append(["build", t, time.perf_counter(), None])
                t = time.perf_counter()
                try:
                    return publish(kind, key, timed_build, *args, **kwargs)
                finally:
                    events.append(["publish", t, time.perf_counter(), None])

            store.publish = timed_publish


def _spans(events: list, name: str) -> list[tuple[float, float]]:
    return [(e[1], e[2]) for e in events if e[0] == name]


def _total(events: list, name: str) -> float:
    return sum(b - a for a, b in _spans(events, name))


def profile(run: dict, warm_steps: int) -> dict:
    """Steady state: the training steps after the first `warm_steps` of the first epoch (and after the first
    step of every later epoch: its interval holds the epoch's start), each timed from the end of the step before
    to its own end, so loading its batch counts. Start-up: the run's seconds that steady-state throughput does
    not explain (total - all training tokens / steady rate), split into the spans that make them."""
    ev, t0, t1 = run["events"], run["t0"], run["t1"]
    epochs = _spans(ev, "epoch")
    batches = [e for e in ev if e[0] == "batch"]
    ends = [e[2] for e in ev if e[0] == "step"]
    if len(batches) != len(ends):
        raise RuntimeError(f"step clock: {len(batches)} batches but {len(ends)} step ends")
    window_tokens, window_s, warm_end, first_epoch_start = 0, 0.0, None, epochs[0][0] if epochs else t0
    n_in_epoch, prev = {}, None
    for (_, _, _, tokens), end in zip(batches, ends):
        epoch = next((i for i, (a, b) in enumerate(epochs) if a <= end <= b), len(epochs))
        n_in_epoch[epoch] = n_in_epoch.get(epoch, 0) + 1
        n = n_in_epoch[epoch]
        if epoch == 0 and n == warm_steps:
            warm_end = end
        if n > (warm_steps if epoch == 0 else 1) and prev is not None:
            window_tokens += tokens
            window_s += end - prev
        prev = end
    if not window_s:
        raise RuntimeError(f"step clock: no steady-state steps (only {len(ends)} steps; warm-up {warm_steps})")
    rate = window_tokens / window_s
    tokens = sum(b[3] for b in batches)
    total = t1 - t0
    main = _spans(ev, "speculators main")
    main_s, main_e = main[-1] if main else (t0, t1)
    warm_tokens = sum(b[3] for b in batches[:warm_steps])
    last_inside = max([e[2] for e in ev if e[0] in ("step", "validation", "checkpoint save")] or [main_e])
    items = {
        "before speculators main": main_s - t0,
        "speculators set-up (model, verifier weights, data)": first_epoch_start - main_s,
        f"first {warm_steps} steps beyond steady rate": (warm_end - first_epoch_start) - warm_tokens / rate
        if warm_end else 0.0,
        "validation": _total(ev, "validation"),
        "checkpoint saves": _total(ev, "checkpoint save"),
        "speculators after the last step": main_e - last_inside,
        "after speculators main": t1 - main_e,
    }
    if run.get("pipeline"):
        pub = _spans(ev, "publish")
        build = _spans(ev, "build")
        train = _spans(ev, "eaglet train_draft")
        if pub and build and train:
            items.pop("before speculators main")
            items.pop("after speculators main")
            items = {
                "Prefect task start + cache key": pub[-1][0] - t0,
                "store: lock, partial dir, checkpoint check": build[-1][0] - pub[-1][0] + (train[-1][0] - build[-1][0]),
                "eaglet train_draft before main (TrainConfig, metrics recorder)": main_s - train[-1][0],
                **items,
                "eaglet train_draft after main": train[-1][1] - main_e,
                "final bf16 draft": _total(ev, "final bf16 draft"),
                "build after training (argv file etc.)": build[-1][1] - train[-1][1] - _total(ev, "final bf16 draft"),
                "store: manifest (sha256 of every file) + rename": pub[-1][1] - build[-1][1],
                "Prefect task end (result, state)": t1 - pub[-1][1],
            }
    steady_all = tokens / rate
    items["unaccounted"] = total - steady_all - sum(items.values())
    return {"seconds": total, "tokens": tokens, "steps": len(ends), "window_steps": sum(
        max(0, n - (warm_steps if e == 0 else 1)) for e, n in n_in_epoch.items()), "steady_tokens_per_s": rate,
        "startup_s": total - steady_all, "startup_items": items}
