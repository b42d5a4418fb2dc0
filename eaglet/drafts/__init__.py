"""Draft architectures, one module each: what speculators trains, what vLLM loads, what can go wrong between.

Each module gives the same few things, and nothing else in eaglet knows which architecture it runs:
  METHOD                                  vLLM's speculative_config method
  DEFAULT_LOSS, default_k(dflash)         what an empty training.loss and smoke.num_speculative_tokens mean
  speculators_args(draft, training, dflash)  its `speculators train` flags (type, model, loss shaping)
  shape_args(draft, dflash)               the flags that size a draft trained from scratch
  score(val_metrics)                      the acceptance length an epoch's validation predicts (best epoch)
  simulate(epoch_dir, argv, out, stream)  decoding simulated on the validation rows, or None
  export(ckpt_dir, out, verifier, export) the draft vLLM loads, written into `out` and checked
  validate(draft_dir, verifier)           every hazard vLLM would fail on or silently mis-serve (a Report)
  flatten_refusal                         None, or why `eaglet flatten` makes no sense for it
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from eaglet.drafts import dflash, eagle3
from eaglet.errors import EagletError

ARCHITECTURES: dict[str, ModuleType] = {"eagle3": eagle3, "dflash": dflash}


def of(architecture: str) -> ModuleType:
    return ARCHITECTURES[architecture]


def of_checkpoint(path: str | Path) -> ModuleType:
    """The architecture of a draft directory: speculators' type in its config, or vLLM's flat EAGLE-3 form."""
    from eaglet.convert import read_config

    cfg = read_config(Path(path))
    kind = cfg.get("speculators_model_type")
    if kind is None:
        return eagle3  # a flat draft (LlamaForCausalLMEagle3): eaglet.convert.validate says if it is not one
    if kind not in ARCHITECTURES:
        raise EagletError(f"{path} is a speculators {kind!r} draft: eaglet trains and serves "
                          f"{', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[kind]
