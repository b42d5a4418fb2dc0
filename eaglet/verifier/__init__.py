"""Resolve a verifier cheaply: config, tokenizer, aux layer ids and a content fingerprint.

Nothing here loads weights. Every check that can fail on user input runs here, before the expensive stages.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from pydantic import BaseModel

from eaglet.errors import EagletError, read_json_file

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
SAMPLE_BYTES = 1 << 20  # bytes hashed at each end of every weight file


class VerifierInfo(BaseModel):
    """What later stages need to know about the verifier, without its weights."""

    path: str
    fingerprint: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: list[int]
    trust_remote_code: bool = False
    nested_text_config: bool = False

    def summary(self) -> str:
        return (f"verifier {self.model_type}: {self.num_layers} layers, hidden {self.hidden_size}, vocab "
                f"{self.vocab_size}, aux ids {self.aux_layer_ids}, fingerprint {self.fingerprint}")


def read_config_dict(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise EagletError(f"verifier {path} has no config.json: point verifier.path at a Hugging Face checkpoint directory")
    return read_json_file(cfg_file, "verifier config")


def text_config_of(cfg: dict) -> dict:
    """Kimi-K2.5 and VL models keep the language model's fields under `text_config`."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def verifier_weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise EagletError(
                f"verifier {path} has only pickle weights ({', '.join(pickles[:3])}); eaglet loads safetensors only: "
                "convert with `model.save_pretrained(dir, safe_serialization=True)`"
            )
        raise EagletError(f"verifier {path} has no *.safetensors weights")
    return files


def default_aux_layer_ids(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    if len(set(ids)) != len(ids):
        raise EagletError(
            f"aux layer ids {ids} contain duplicates: vLLM captures each layer once, so fc would get too few columns; "
            "choose distinct ids"
        )
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise EagletError(f"aux layer ids {bad} are outside the verifier's layers 0..{num_layers - 1}")
    return sorted(ids)


def _safetensors_identity(file: Path, h: "hashlib._Hash") -> None:
    """Cheap, sound identity of a weight file: size, full header (names, dtypes, shapes, offsets), and the
    first and last MiB of tensor data. Hashing every byte of a 1 TB checkpoint is not acceptable."""
    size = file.stat().st_size
    with file.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        h.update(file.name.encode())
        h.update(str(size).encode())
        h.update(f.read(header_len))
        h.update(f.read(SAMPLE_BYTES))
        f.seek(max(8 + header_len, size - SAMPLE_BYTES))
        h.update(f.read(SAMPLE_BYTES))


def fingerprint_verifier(path: Path) -> str:
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for name in TOKENIZER_FILES:
        f = path / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    for f in verifier_weight_files(path):
        _safetensors_identity(f, h)
    return h.hexdigest()[:16]


def resolve_verifier(path: str | Path, aux_layer_ids: list[int] | None = None, trust_remote_code: bool = False) -> VerifierInfo:
    """Validate a verifier directory and describe it. Loads no weights."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise EagletError(f"verifier {path} is not a directory")
    cfg = read_config_dict(path)
    if cfg.get("auto_map") and not trust_remote_code:
        raise EagletError(
            f"verifier {path} needs its own modelling code (auto_map in config.json); "
            "set verifier.trust_remote_code=true if you trust it"
        )
    verifier_weight_files(path)
    text = text_config_of(cfg)
    try:
        num_layers = int(text["num_hidden_layers"])
        hidden_size = int(text["hidden_size"])
        vocab_size = int(text["vocab_size"])
    except KeyError as e:
        raise EagletError(f"verifier config {path}/config.json lacks {e.args[0]}") from None

    from transformers import AutoTokenizer  # deferred: transformers is slow to import

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a user-facing input problem
        raise EagletError(f"cannot load the verifier's tokenizer from {path}: {e}") from None
    if not getattr(tok, "chat_template", None):
        raise EagletError(
            f"verifier {path} has no chat template; add one to tokenizer_config.json (chat_template) or chat_template.jinja"
        )

    ids = aux_layer_ids if aux_layer_ids else default_aux_layer_ids(num_layers)
    ids = check_aux_layer_ids(list(ids), num_layers)
    return VerifierInfo(
        path=str(path),
        fingerprint=fingerprint_verifier(path),
        model_type=str(text.get("model_type", cfg.get("model_type", "unknown"))),
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        aux_layer_ids=ids,
        trust_remote_code=trust_remote_code,
        nested_text_config=text is not cfg,
    )


def check_draft_vocab_size(draft_vocab_size: int, vocab_size: int) -> None:
    if draft_vocab_size > vocab_size:
        raise EagletError(
            f"draft.draft_vocab_size={draft_vocab_size} is larger than the verifier's vocabulary ({vocab_size}); "
            f"use at most {vocab_size}"
        )
