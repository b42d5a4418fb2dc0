"""DFlash (speculators `dflash`, vLLM `dflash`): block diffusion. The draft reads the verifier's aux states (the
same layers and the same captured rows as EAGLE-3) and fills a block of dflash.block_size positions, an anchor and
block_size-1 mask tokens, in one forward with bidirectional attention inside the block; vLLM drafts
block_size-1 tokens per step. Its layers are Qwen3-style (q/k norms) whatever the verifier is; vLLM 0.32 accepts a
Llama verifier (docs/dflash.md).

vLLM reads speculators' checkpoint directly (`speculators_model_type`, `transformer_layer_config`), so the export
is that checkpoint as it is, checked: there is no flat form. What vLLM 0.32 would fail on or silently mis-serve is
in `validate`, each hazard by name."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from eaglet.config import ExportParams, RunConfig, loss_spec
from eaglet.drafts.base import DraftArchitecture, ValidationReport
from eaglet.drafts.checkpoint import read_config, write_json
from eaglet.drafts.dflash.validate import validate as validate_dflash
from eaglet.errors import EagletError
from eaglet.store import link_or_copy


class DFlash(DraftArchitecture):
    name = "dflash"
    method = "dflash"
    default_loss = "ce"  # speculators' for dflash; its dpace position weighting requires it
    export_kind = "draft_dflash"
    export_version = "dflash-1"
    served_form = "speculators' DFlash checkpoint, which vLLM loads as it is"
    score_meaning = "speculators' eal, the accepted run per block + 1"
    settings_section = "dflash"
    flatten_refusal = ("a DFlash draft has no flat form: vLLM loads speculators' checkpoint directory as it is "
                       "(method dflash), so serve or `eaglet validate` the directory itself")

    def default_k(self, cfg: RunConfig) -> int:
        return cfg.dflash.block_size - 1  # the anchor is known: a block drafts the positions after it

    def max_k(self, cfg: RunConfig) -> int:
        return cfg.dflash.block_size - 1

    def check(self, cfg: RunConfig) -> None:
        k, block = cfg.smoke.num_speculative_tokens, cfg.dflash.block_size
        if k is not None and k > block - 1:
            raise EagletError(f"smoke.num_speculative_tokens={k} is more than a DFlash block of {block} can draft "
                              f"({block - 1}): lower it or raise dflash.block_size")
        super().check(cfg)
        if cfg.dflash.position_weight == "dpace" and self.loss(cfg) != "ce":
            raise EagletError(f"dflash.position_weight=dpace needs training.loss=ce (speculators' rule), not "
                              f"{loss_spec(cfg.training.loss)}: set training.loss=ce or "
                              "dflash.position_weight=exp_decay")

    def speculators_args(self, cfg: RunConfig) -> list[str]:
        d = cfg.dflash
        args = ["--speculator-type", "dflash",
                "--block-size", str(d.block_size),
                "--max-anchors", str(d.max_anchors),
                "--per-position-loss-weight", {"dpace": "dpace", "exp_decay": "fixed-exp-decay"}[d.position_weight],
                "--dflash-decay-gamma", str(d.decay_gamma)]
        if d.mask_token_id is not None:
            args += ["--mask-token-id", str(d.mask_token_id)]
        return args

    def shape_args(self, cfg: RunConfig) -> list[str]:
        # Every layer full attention, bidirectional: vLLM's V1 runner refuses a mix of sliding and full layers, and
        # serves all layers causal unless sliding_window_non_causal is set (speculators trains full layers
        # bidirectionally either way).
        n = cfg.dflash.num_layers
        return ["--num-layers", str(n), "--draft-arch", "qwen3",
                "--full-attention-indices", *[str(i) for i in range(n)], "--sliding-window-non-causal"]

    def score(self, val_metrics: Mapping[str, float]) -> float | None:
        """speculators' `eal`: per block, the run of right positions after the anchor plus the verifier's bonus
        token, which is what vLLM's mean acceptance length measures (1 + accepted / drafts)."""
        return next((v for k, v in val_metrics.items() if k == "eal" or k.startswith("eal_")), None)

    def owns(self, config: dict) -> bool:
        return config.get("speculators_model_type") == self.name

    def export(self, ckpt_dir: Path, out: Path, verifier: str, export: ExportParams) -> None:
        """The delivered checkpoint's config and weights (hard links where possible), the verifier id replaced by
        export.serving_id; checked as vLLM would load it."""
        cfg = read_config(ckpt_dir)
        if export.serving_id:  # the training machine's path means nothing where the draft is served
            spec = cfg["speculators_config"]
            cfg = {**cfg, "speculators_config": {**spec, "verifier": {**spec["verifier"],
                                                                       "name_or_path": export.serving_id}}}
        write_json(out / "config.json", cfg)
        link_or_copy(ckpt_dir / "model.safetensors", out / "model.safetensors")
        validate_dflash(out, verifier).raise_problems(out)

    def validate(self, draft_dir: Path, verifier: str) -> ValidationReport:
        return validate_dflash(draft_dir, verifier)


ARCHITECTURE = DFlash()
