"""The one interface a draft architecture provides. eaglet.drafts.registry registers each architecture once; every other
part of eaglet (training, keys, export, validation, smoke test, report, CLI) asks the architecture through these
methods and never names one.

A new architecture is one package under eaglet/drafts/ with a `DraftArchitecture` subclass, added to
eaglet.drafts.registry.ARCHITECTURES (or `registry.register`), plus its tests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

from eaglet.config import ExportParams, RunConfig
from eaglet.errors import EagletError


class ValidationReport:
    """Every problem found in a draft (vLLM would fail, or silently serve it worse) and every warning (it loads,
    but it is worth knowing)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.warnings: list[str] = []

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_problems(self, draft: Path) -> ValidationReport:
        """Every problem at once, as one user error (vLLM reports none of them); the report when there are none."""
        if self.problems:
            raise EagletError(f"draft {draft} would not work in vLLM: " + "; ".join(self.problems))
        return self


class DraftArchitecture(ABC):
    """A draft speculators trains and vLLM serves. Class attributes say what it is; methods say what it does."""

    name: str  # draft.architecture, speculators' --speculator-type and its checkpoints' speculators_model_type
    method: str  # vLLM's speculative_config method
    default_loss: str  # what an empty training.loss means
    export_kind: str  # the store kind of what vLLM loads (keys.export_key, the export-draft task)
    export_version: str  # bump when the export of the same checkpoint changes
    served_form: str  # what vLLM loads, for the report and the UI
    score_meaning: str  # what `score` measures, for the report
    settings_section: str | None = None  # the RunConfig section of its own settings, if any (enters its keys)

    # --- settings -------------------------------------------------------------------------------------------

    def loss(self, cfg: RunConfig) -> str | dict[str, float]:
        """training.loss resolved: empty is the architecture's."""
        return cfg.training.loss if cfg.training.loss is not None else self.default_loss

    @abstractmethod
    def default_k(self, cfg: RunConfig) -> int:
        """Draft tokens per step when smoke.num_speculative_tokens is empty."""

    def k(self, cfg: RunConfig) -> int:
        """smoke.num_speculative_tokens resolved."""
        k = cfg.smoke.num_speculative_tokens
        return k if k is not None else self.default_k(cfg)

    def max_k(self, cfg: RunConfig) -> int | None:
        """The most draft tokens per step the trained draft can propose (None: no limit of its own)."""
        return None

    def check(self, cfg: RunConfig) -> None:
        """Settings that do not fit this architecture, as one EagletError sentence, before any load."""
        limit = self.max_k(cfg)
        k = cfg.smoke.num_speculative_tokens
        if limit is not None and k is not None and k > limit:
            raise EagletError(f"smoke.num_speculative_tokens={k} is more than a {self.name} draft of these settings "
                              f"can propose ({limit})")
        if cfg.draft.like and not self.takes_reference:
            raise EagletError(f"draft.like (a reference draft's shapes) does not apply to {self.name} drafts: leave "
                              f"it empty with draft.architecture={self.name}")

    def key_settings(self, cfg: RunConfig) -> dict:
        """The draft's settings as the keys see them: the draft section, the architecture's name and its own
        section."""
        settings = cfg.draft.model_dump(exclude={"like", "architecture"}) | {"architecture": self.name}
        if self.settings_section:
            settings[self.settings_section] = getattr(cfg, self.settings_section).model_dump()
        return settings

    # --- a reference draft's shapes (draft.like) ------------------------------------------------------------

    takes_reference: bool = False  # whether draft.like (a published draft's shapes) applies

    def reference(self, cfg: RunConfig) -> dict | None:
        """The content of draft.like, as the keys see it (None without one)."""
        return None

    def apply_reference(self, cfg: RunConfig) -> RunConfig:
        """The run's parameters with the reference's shape-fixing settings."""
        return cfg

    def check_reference(self, cfg: RunConfig, hidden_size: int, vocab_size: int) -> None:
        """draft.like against the verifier's shape, before any load."""

    def reference_layer_config(self, cfg: RunConfig) -> dict | None:
        """speculators' --draft-config for draft.like (None: the verifier's shapes)."""
        return None

    # --- training ------------------------------------------------------------------------------------------

    @abstractmethod
    def speculators_args(self, cfg: RunConfig) -> list[str]:
        """Its `speculators train` flags: type and loss shaping."""

    @abstractmethod
    def shape_args(self, cfg: RunConfig) -> list[str]:
        """The flags that size a draft trained from scratch."""

    @abstractmethod
    def score(self, val_metrics: Mapping[str, float]) -> float | None:
        """The acceptance length an epoch's validation metrics predict (picks the delivered epoch)."""

    def simulate(self, epoch_dir: Path, argv: list[str], out: Path, stream: dict | None) -> dict | None:
        """Decoding simulated on the validation rows (written to `out`), or None where it has no simulator."""
        return None

    # --- what vLLM loads -----------------------------------------------------------------------------------

    @abstractmethod
    def owns(self, config: dict) -> bool:
        """Whether a draft directory's config.json is one of this architecture's."""

    @abstractmethod
    def export(self, ckpt_dir: Path, out: Path, verifier: str, export: ExportParams) -> None:
        """Write what vLLM loads for the delivered checkpoint into the empty directory `out`, checked."""

    @abstractmethod
    def validate(self, draft_dir: Path, verifier: str) -> ValidationReport:
        """Every hazard vLLM would fail on or silently mis-serve, without starting vLLM."""

    def check_before_serving(self, draft_dir: Path, verifier: str) -> ValidationReport:
        """What `eaglet smoke` checks before it starts vLLM (vLLM itself reports none of it)."""
        return self.validate(draft_dir, verifier).raise_problems(draft_dir)

    flatten_refusal: str | None = None  # why `eaglet flatten`/`unflatten` do not apply, if they do not

    def flatten(self, src: Path, dst: Path, verifier: str | None, export: ExportParams) -> dict:
        """speculators' checkpoint -> the flat form (`eaglet flatten`)."""
        raise EagletError(self.flatten_refusal or f"{self.name} drafts have no flat form")

    def unflatten(self, src: Path, dst: Path, verifier: str, k: int) -> dict:
        """The flat form -> speculators' checkpoint (`eaglet unflatten`)."""
        raise EagletError(self.flatten_refusal or f"{self.name} drafts have no flat form")

    def smoke_job(self, draft_dir: str, k: int) -> dict:
        """vLLM's speculative_config for serving the draft with k tokens per step."""
        return {"method": self.method, "model": draft_dir, "num_speculative_tokens": k}
