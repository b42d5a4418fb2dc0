"""`eaglet` command line: `eaglet run` (the flow, locally) and `eaglet smoke` (the vLLM check alone).

It sits with the deployments at the top of the chain: it may import flows, nothing imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def _prefect_env() -> None:
    """Defaults that must be set before Prefect is imported."""
    from eaglet.store import store_root

    # Prefect 3.6.27-3.8.5 ignore PREFECT_HOME for results: caching needs an explicit result store.
    os.environ.setdefault("PREFECT_RESULTS_LOCAL_STORAGE_PATH", str(store_root() / "prefect-results"))
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "eaglet,speculators")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here; avoids telemetry errors


class _QuietUserErrors(logging.Filter):
    """Prefect logs a failed task's traceback; for a user error the one-line message is the whole story."""

    def filter(self, record: logging.LogRecord) -> bool:
        from eaglet.errors import EagletError

        if record.exc_info and isinstance(record.exc_info[1], EagletError):
            record.exc_info = None
            record.exc_text = None
        return True


def _quiet_user_errors() -> None:
    for name in ("prefect.task_runs", "prefect.flow_runs", "prefect.task_engine", "prefect.flow_engine"):
        logging.getLogger(name).addFilter(_QuietUserErrors())


def cmd_run(args: argparse.Namespace) -> int:
    from eaglet.config import load_config

    params = load_config(args.config, args.set)  # invalid parameters fail here, before Prefect starts
    _prefect_env()
    from flows.train_eagle3 import train_eagle3

    _quiet_user_errors()

    report = train_eagle3(params=params, output_dir=str(Path(args.output_dir).resolve()))
    smoke = report.get("smoke") or {}
    print(f"draft: {report['draft_dir']}")
    if smoke:
        print(f"mean acceptance length {smoke['mean_acceptance_length']:.3f} at k={smoke['num_speculative_tokens']}, "
              f"lossless={smoke['lossless']}")
    print(f"report: {Path(args.output_dir) / 'report.md'}")
    return 0


def cmd_smoke(args: argparse.Namespace) -> int:
    from eaglet.export import check_flat_draft
    from eaglet.smoke import load_prompts, smoke_test

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config_file = Path(args.draft) / "config.json"
    if config_file.is_file() and "speculators_config" not in json.loads(config_file.read_text()):
        check_flat_draft(Path(args.draft), args.verifier)  # flat drafts only: vLLM reports none of these problems
    result = smoke_test(args.verifier, args.draft, load_prompts(args.prompts, args.num_prompts), k=args.k,
                        max_tokens=args.max_tokens, dtype=args.dtype)
    text = result.model_dump_json(indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eaglet", description="Train EAGLE-3 drafts and ship them to vLLM.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the train-eagle3 flow locally")
    run.add_argument("--config", help="YAML file with parameter sections (verifier, data, training, ...)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override one parameter, e.g. --set training.epochs=3 (repeatable)")
    run.add_argument("--output-dir", default="out", help="where draft/, draft-speculators/ and report.* go")
    run.set_defaults(fn=cmd_run)

    smoke = sub.add_parser("smoke", help="load verifier + draft in vLLM and measure acceptance")
    smoke.add_argument("--verifier", required=True)
    smoke.add_argument("--draft", required=True)
    smoke.add_argument("--prompts", required=True, help="JSONL of prompts or conversations")
    smoke.add_argument("--k", type=int, default=3, help="speculative tokens per step")
    smoke.add_argument("--max-tokens", type=int, default=128)
    smoke.add_argument("--num-prompts", type=int, default=None)
    smoke.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="vLLM compute dtype (float32: bit-comparable greedy outputs)")
    smoke.add_argument("--json", help="also write the result here")
    smoke.set_defaults(fn=cmd_smoke)
    return p


def main(argv: list[str] | None = None) -> int:
    from eaglet.errors import EagletError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except EagletError as e:
        print(f"eaglet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
