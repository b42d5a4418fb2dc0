"""The draft architectures, registered once: one package each (eagle3, dflash), each a `DraftArchitecture`
(eaglet.drafts.base). Everything else in eaglet asks this module, and never names one.

  get(name)             the architecture draft.architecture names (one sentence for an unknown name)
  for_run(cfg)          the run's, its settings checked
  of_checkpoint(dir)    the architecture of a draft directory on disk
  check_run(info, cfg)  every check of the draft settings that needs the verifier's shape, before any load
  register(arch)        another architecture (a plug-in, or a test's)
"""

from __future__ import annotations

from pathlib import Path

from eaglet.config import RunConfig
from eaglet.drafts import dflash, eagle3
from eaglet.drafts.base import DraftArchitecture, ValidationReport
from eaglet.drafts.checkpoint import read_config
from eaglet.errors import EagletError
from eaglet.verifier import VerifierInfo, check_draft_vocab_size
from eaglet.train.warm_start import check_init_dir

__all__ = ["ARCHITECTURES", "DraftArchitecture", "ValidationReport", "check_run", "for_run", "get", "of_checkpoint",
           "register"]

ARCHITECTURES: dict[str, DraftArchitecture] = {a.name: a for a in (eagle3.ARCHITECTURE, dflash.ARCHITECTURE)}


def register(arch: DraftArchitecture) -> DraftArchitecture:
    """Add an architecture under its name (a name already taken is refused)."""
    if arch.name in ARCHITECTURES and ARCHITECTURES[arch.name] is not arch:
        raise ValueError(f"a draft architecture named {arch.name!r} is already registered")
    ARCHITECTURES[arch.name] = arch
    return arch


def get(name: str) -> DraftArchitecture:
    if name not in ARCHITECTURES:
        raise EagletError(f"draft.architecture={name!r} is not a draft architecture eaglet knows: use one of "
                          f"{', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def for_run(cfg: RunConfig) -> DraftArchitecture:
    """The run's architecture, with its settings checked (one sentence for settings that do not fit)."""
    arch = get(cfg.draft.architecture)
    arch.check(cfg)
    return arch


def of_checkpoint(path: str | Path) -> DraftArchitecture:
    """The architecture of a draft directory: speculators' type in its config, or vLLM's flat form."""
    cfg = read_config(Path(path))
    owners = [a for a in ARCHITECTURES.values() if a.owns(cfg)]
    if not owners:
        raise EagletError(f"{path} is a speculators {cfg.get('speculators_model_type')!r} draft: eaglet trains and "
                          f"serves {', '.join(ARCHITECTURES)}")
    return owners[0]


def check_run(info: VerifierInfo, cfg: RunConfig) -> None:
    """Every check of a run's draft settings that needs the verifier's shape, before weights load: the
    architecture's own settings, the draft vocabulary, a warm start's directory and a reference draft."""
    arch = for_run(cfg)
    check_draft_vocab_size(cfg.draft.draft_vocab_size, info.vocab_size)
    if cfg.training.init not in ("scratch", "previous"):
        check_init_dir(cfg.training.init, arch.name)
    arch.check_reference(cfg, info.hidden_size, info.vocab_size)
