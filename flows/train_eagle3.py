"""The `train-eagle3` flow: a verifier in, a vLLM-loadable draft of any registered architecture out
(draft.architecture: EAGLE-3 by default, whence the name users' deployments call). It only composes tasks
(tasks.stages): each returns a reference to an artifact in the store, and the next task takes it."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from prefect import flow, get_run_logger

from eaglet.capture.engine import RunEngines
from eaglet.config import RunConfig
from eaglet.data import DEFAULT_PROMPTS
from eaglet.errors import EagletError
from eaglet.keys import comparison_key
from eaglet.store import in_use, is_published
from tasks import stages
from tasks.cache import refreshed
from tasks.report import report_and_promote


class _Ledger(contextlib.ExitStack):
    """Runs the flow's tasks: each one's final state and wall time for the report, and every artifact it returns
    marked in use until the flow ends, so `eaglet cache gc` cannot delete it between two tasks."""

    def __init__(self) -> None:
        super().__init__()
        self.timings: dict = {}

    def __call__(self, name: str, task, *args):
        started, t0 = time.time(), time.perf_counter()
        state = refreshed(task, *args)(*args, return_state=True)
        result = state.result()  # raises the task's exception if it failed
        self.timings[name] = {"state": state.name, "seconds": round(time.perf_counter() - t0, 2), "started": started,
                              "result": result}
        if isinstance(result, str) and is_published(Path(result)):
            self.enter_context(in_use(result))
        return result


@flow(name="train-eagle3")  # no log_prints: dill (datasets hashing) prints disassembly through print()
def train_eagle3(params: RunConfig = RunConfig(), output_dir: str = "out") -> dict:
    """Train a draft (draft.architecture) for a verifier, check it in vLLM, report and promote it."""
    started = time.time()
    with _Ledger() as run, RunEngines() as engines:
        # Cheap checks before anything loads weights (the embedded verifier's conversion does).
        if params.draft.like:
            params = run("read-reference", stages.apply_reference, params)
        data_dir = run("prepare-data", stages.prepare_data, params.data.path or str(DEFAULT_PROMPTS), params)
        verifier_path = params.verifier.path or run("convert-embedded-verifier", stages.convert_embedded_verifier,
                                                    params.verifier.aux_layer_ids, params.draft.draft_vocab_size)
        verifier = run("resolve-verifier", stages.resolve_run_verifier, verifier_path, params)
        artifacts = {"data": data_dir}

        # The data pass: the verifier answers the training prompts and its hidden states are captured.
        plan = run("plan-capture", stages.plan_capture, verifier, data_dir, params)
        if plan["backend"] == "vllm":
            if plan["to_compute"]:  # the verifier loads only for rows the store does not hold
                engines.hold(run("load-verifier", stages.load_verifier, verifier, params))
            states_dir = run("generate-and-capture", stages.generate_and_capture, verifier, data_dir, engines.fleet,
                             plan["plan"], params)
            if engines.give_baseline(params):  # the smoke test's baseline while the engines are up
                run("baseline-from-capture-engine", stages.baseline_from_capture_engine, verifier, data_dir,
                    engines.fleet, params)
        else:
            conversations_dir = data_dir
            if params.data.regenerate:
                conversations_dir = artifacts["responses"] = run("regenerate-responses", stages.regenerate_responses,
                                                                 verifier, data_dir, params)
            states_dir = run("extract-hidden-states", stages.extract_hidden_states, verifier, conversations_dir,
                             params)

        # Training: speculators, from scratch or warm-started; streamed states keep one engine up for it.
        warm_start = None
        if params.training.init != "scratch":
            warm_start = run("find-warm-start", stages.find_warm_start, verifier, states_dir, data_dir, params)
        init_dir = warm_start["from"] if warm_start else None
        vocab_dir = run("build-vocab", stages.build_vocab, verifier, states_dir, init_dir, params)
        streams = run("plan-training", stages.plan_training, verifier, states_dir, vocab_dir, init_dir,
                      params)["streams"]
        if not streams:
            engines.stop()  # states kept: the engines stop before training needs the memory
        elif not engines.fleet:  # streamed states and no engine up (every row known): training's own load
            engines.hold(run("load-verifier", stages.load_verifier, verifier, params))
        elif len(engines.fleet) > 1:  # training streams from one engine
            engines.hold(run("stop-spare-engines", stages.stop_spare_engines, engines.fleet))
        ckpt_dir = run("train-draft", stages.train_draft, verifier, states_dir, vocab_dir, init_dir, data_dir, params,
                       engines.fleet if streams else None)
        if streams:  # the engines' life spans training: their stop is a step of its own
            run("stop-verifier", stages.stop_verifier, engines.fleet)

        # What vLLM loads, checked, then measured with the verifier.
        draft_dir = run("export-draft", stages.export_draft, verifier, ckpt_dir, params)
        run("validate-draft", stages.validate_draft, verifier, draft_dir)
        smoke = None
        if params.smoke.enabled:
            artifacts["baseline"] = run("verifier-baseline", stages.verifier_baseline, verifier, data_dir, params)
        if params.evaluates:  # is it worth serving: suites, levels, k; the trained k's server answers the smoke test
            artifacts["serving_baseline"] = run("verifier-serving", stages.verifier_serving, verifier, params)
            artifacts["evaluation"] = run("evaluate-draft", stages.evaluate_draft, verifier, draft_dir, ckpt_dir,
                                          artifacts["serving_baseline"], params, data_dir, artifacts["baseline"])
        if params.smoke.enabled:
            smoke = run("smoke-test", stages.smoke_test_run, verifier, draft_dir, data_dir, artifacts["baseline"], params,
                        artifacts.get("evaluation"))

        artifacts |= {"hidden_states": states_dir, "vocab": vocab_dir, "checkpoint": ckpt_dir, "draft": draft_dir}
        report = report_and_promote(str(Path(output_dir).resolve()), params, verifier, run.timings, artifacts, smoke,
                                    comparison_key(verifier, data_dir, params), warm_start, started)
    get_run_logger().info(f"draft written to {report['draft_dir']}; report at {Path(output_dir) / 'report.md'}")
    if report["gate_failure"]:  # after the report: a failed CI job still shows what the draft reached
        raise EagletError(f"quality gate: {report['gate_failure']}")
    return report
