"""EAGLE-3 (speculators `eagle3`, vLLM `eagle3`): one Llama layer over [token embedding, fc(aux states)] that
proposes k tokens one after another; speculators unrolls it training.ttt_steps times (test-time training). vLLM
loads the flat `LlamaForCausalLMEagle3` form.

- form: the flat form's names and defaults
- flat: speculators' checkpoint -> the flat form, and back
- validate: every hazard of a flat draft in vLLM's loader
- reference: draft.like, a published flat draft's shapes
- acceptance: the score that picks the delivered epoch, and decoding simulated on the validation rows
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from eaglet.config import ExportParams, RunConfig
from eaglet.drafts.base import DraftArchitecture, ValidationReport
from eaglet.drafts.checkpoint import is_nested, read_config
from eaglet.drafts.eagle3 import acceptance, flat, reference
from eaglet.drafts.eagle3.validate import check_flat_draft, validate as validate_flat


class Eagle3(DraftArchitecture):
    name = "eagle3"
    method = "eagle3"
    default_loss = "kl_div"  # to the verifier's distribution
    export_kind = "draft_flat"
    export_version = "flat-2"
    served_form = "the flat LlamaForCausalLMEagle3 draft vLLM loads"
    score_meaning = "1 + the sum of speculators' full_acc_k, the position average"
    takes_reference = True

    def default_k(self, cfg: RunConfig) -> int:
        return 3

    def key_settings(self, cfg: RunConfig) -> dict:
        # the keys of drafts trained before there was a second architecture: no name, no section of its own
        return cfg.draft.model_dump(exclude={"like", "architecture"})

    def reference(self, cfg: RunConfig) -> dict | None:
        return reference.read_reference(cfg.draft.like) if cfg.draft.like else None

    def apply_reference(self, cfg: RunConfig) -> RunConfig:
        return reference.apply_reference(cfg)

    def check_reference(self, cfg: RunConfig, hidden_size: int, vocab_size: int) -> None:
        if cfg.draft.like:
            reference.check_reference(self.reference(cfg), hidden_size, vocab_size, cfg.draft.like)

    def reference_layer_config(self, cfg: RunConfig) -> dict | None:
        return reference.reference_layer_config(self.reference(cfg)) if cfg.draft.like else None

    def speculators_args(self, cfg: RunConfig) -> list[str]:
        draft, training = cfg.draft, cfg.training
        flag = lambda name, on: f"--{name}" if on else f"--no-{name}"  # noqa: E731
        return ["--speculator-type", "eagle3",
                flag("norm-before-residual", draft.norm_before_residual),
                flag("norm-before-fc", draft.norm_before_fc),
                flag("norm-output", draft.norm_output),
                "--ttt-steps", str(training.ttt_steps),
                "--ttt-step-loss-decay", str(training.ttt_step_loss_decay)]

    def shape_args(self, cfg: RunConfig) -> list[str]:
        return ["--num-layers", "1", "--draft-arch", "llama", "--full-attention-indices", "0"]

    def score(self, val_metrics: Mapping[str, float]) -> float | None:
        return acceptance.position_average(val_metrics)

    def simulate(self, epoch_dir: Path, argv: list[str], out: Path, stream: dict | None) -> dict | None:
        return acceptance.write(epoch_dir, argv, out, stream)

    def owns(self, config: dict) -> bool:
        # speculators' nested checkpoint, or vLLM's flat form (no speculators_model_type; validate says if not)
        return config.get("speculators_model_type", self.name) == self.name

    def export(self, ckpt_dir: Path, out: Path, verifier: str, export: ExportParams) -> None:
        flat.write_flat(ckpt_dir, out, verifier, serving_id=export.serving_id, layer_prefix=export.layer_prefix,
                        keep_embeddings=export.keep_embeddings)
        check_flat_draft(out, verifier)

    def validate(self, draft_dir: Path, verifier: str) -> ValidationReport:
        return validate_flat(draft_dir, verifier)

    def check_before_serving(self, draft_dir: Path, verifier: str) -> ValidationReport:
        if is_nested(read_config(Path(draft_dir))):  # vLLM reads speculators' own form; the checks are the flat one's
            return ValidationReport()
        return super().check_before_serving(draft_dir, verifier)

    def flatten(self, src: Path, dst: Path, verifier: str | None, export: ExportParams) -> dict:
        return flat.flatten(src, dst, verifier, serving_id=export.serving_id, layer_prefix=export.layer_prefix,
                            keep_embeddings=export.keep_embeddings)

    def unflatten(self, src: Path, dst: Path, verifier: str, k: int) -> dict:
        return flat.unflatten(src, dst, verifier, speculative_tokens=k)


ARCHITECTURE = Eagle3()
