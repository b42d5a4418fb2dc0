"""EAGLE-3 (speculators `eagle3`, vLLM `eagle3`): one Llama layer over [token embedding, fc(aux states)] that
proposes k tokens one after another; speculators unrolls it training.ttt_steps times (test-time training). vLLM
loads the flat `LlamaForCausalLMEagle3` form (eaglet.convert)."""

from __future__ import annotations

from pathlib import Path

from eaglet import convert

METHOD = "eagle3"
DEFAULT_LOSS = "kl_div"  # to the verifier's distribution
flatten_refusal = None


def default_k(dflash=None) -> int:
    return 3


def speculators_args(draft, training, dflash=None) -> list[str]:
    flag = lambda name, on: f"--{name}" if on else f"--no-{name}"  # noqa: E731
    return ["--speculator-type", "eagle3",
            flag("norm-before-residual", draft.norm_before_residual),
            flag("norm-before-fc", draft.norm_before_fc),
            flag("norm-output", draft.norm_output),
            "--ttt-steps", str(training.ttt_steps),
            "--ttt-step-loss-decay", str(training.ttt_step_loss_decay)]


def shape_args(draft, dflash=None) -> list[str]:
    return ["--num-layers", "1", "--draft-arch", "llama", "--full-attention-indices", "0"]


def score(val_metrics: dict) -> float | None:
    from eaglet.train.metrics import simulated_acceptance

    return simulated_acceptance(val_metrics)


def simulate(epoch_dir: Path, argv: list[str], out: Path, stream: dict | None) -> dict | None:
    from eaglet.train import acceptance

    return acceptance.write(epoch_dir, argv, out, stream)


def export(ckpt_dir: Path, out: Path, verifier: str, e) -> None:
    convert.write_flat(ckpt_dir, out, verifier, serving_id=e.serving_id, layer_prefix=e.layer_prefix,
                       keep_embeddings=e.keep_embeddings)
    convert.check_flat_draft(out, verifier)


def validate(draft: Path, verifier: str) -> convert.Report:
    return convert.validate(draft, verifier)
