"""Kimi-K2.5, the motivating verifier: the golden flat config of a Kimi-shaped draft (built on the meta device,
nothing of its 4.6 GB allocated), and a tiny Kimi-K2.5-shaped verifier through extraction, training and flatten."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglet.config import load_config
from eaglet.drafts.checkpoint import tensor_meta, write_json
from eaglet.drafts.eagle3.flat import flat_config
from eaglet.drafts.eagle3.reference import apply_reference, read_reference, reference_layer_config
from eaglet.drafts.eagle3.validate import expected_shapes, validate
from eaglet.errors import EagletError
from tests.conftest import PROMPTS, run_cli
from tests.kimi import KIMI_DRAFT_REFERENCE, KIMI_K25, make_tiny_kimi_verifier, write_config_only

GOLDEN = {
    "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168, "num_attention_heads": 64,
    "num_key_value_heads": 64, "head_dim": 128, "intermediate_size": 18432, "num_hidden_layers": 1,
    "vocab_size": 163840, "draft_vocab_size": 32000, "rope_theta": 1000000.0, "max_position_embeddings": 131072,
    "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def test_kimi_k25_draft_flattens_to_the_golden_config(tmp_path):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.utils import resolve_target_layer_ids
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.cli import load_draft_transformer_layer_config

    verifier = write_config_only(tmp_path / "Kimi-K2.5", KIMI_K25)  # the real config, no weights
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps(KIMI_DRAFT_REFERENCE))
    params = apply_reference(load_config(None, [f"draft.like={reference}", f"verifier.path={verifier}"]))
    assert params.draft.draft_vocab_size == 32000 and params.draft.norm_before_fc is False

    # exactly what the train-draft task hands speculators: --draft-config with the reference's layer shapes
    layer_file = tmp_path / "draft_layer_config.json"
    write_json(layer_file, reference_layer_config(read_reference(reference)))
    layer = load_draft_transformer_layer_config(str(layer_file), str(verifier))
    layer._attn_implementation = "sdpa"
    ids = resolve_target_layer_ids(params.verifier.aux_layer_ids, str(verifier))  # read through text_config
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=params.draft.draft_vocab_size,
        norm_before_residual=params.draft.norm_before_residual, norm_before_fc=params.draft.norm_before_fc,
        norm_output=params.draft.norm_output, eagle_aux_hidden_state_layer_ids=ids,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(verifier), architectures=KIMI_K25["architectures"]),
        ),
    )
    with torch.device("meta"):
        model = Eagle3DraftModel(config)
    saved = {k: v for k, v in model.state_dict().items() if k not in model._keys_to_ignore_on_save}
    assert all(t.is_meta for t in saved.values())

    flat = flat_config(config.to_dict(), KIMI_K25, q_rows=saved["layers.0.self_attn.q_proj.weight"].shape[0],
                       dtype="bfloat16")
    assert {k: flat[k] for k in GOLDEN} == GOLDEN
    assert flat["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert flat["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58] and flat["num_aux_hidden_states"] == 3
    assert flat["eagle_config"]["use_aux_hidden_state"] is True and flat["target_hidden_size"] == 7168
    assert flat["hidden_size"] // flat["num_attention_heads"] == 112  # the value a derived head_dim would take

    # every weight the draft has is the shape the flat config promises vLLM
    want = expected_shapes(flat, "layers.0")
    for name, shape in want.items():
        assert list(saved[name].shape) == shape, name
    assert list(saved["embed_tokens.weight"].shape) == [163840, 7168]
    bf16_bytes = sum(t.numel() * 2 for k, t in saved.items() if k not in ("d2t", "t2d"))
    assert 4.6e9 < bf16_bytes < 4.8e9  # ~4.7 GB: the published Kimi draft's size, 2.35 GB of it embeddings


def test_reference_conflicts_are_user_errors(tmp_path):
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps(KIMI_DRAFT_REFERENCE))
    with pytest.raises(EagletError, match="draft_vocab_size is 4096 but draft.like"):
        apply_reference(load_config(None, [f"draft.like={reference}", "draft.draft_vocab_size=4096"]))
    with pytest.raises(EagletError, match="neither a config file"):
        apply_reference(load_config(None, [f"draft.like={tmp_path / 'missing'}"]))


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory) -> Path:
    return make_tiny_kimi_verifier(tmp_path_factory.mktemp("kimi") / "tiny-kimi-k25", PROMPTS)


@pytest.mark.e2e
def test_tiny_kimi_k25_extraction_training_flatten(tiny_kimi, tmp_path):
    """text_config nesting read throughout; the draft takes a reference's shapes (head_dim 64, not the
    DeepseekV3 text config's 32) through real speculators training."""
    data = tmp_path / "conversations.jsonl"  # given responses: regeneration would need vLLM to serve kimi_k25
    with data.open("w") as f:
        for line in PROMPTS.read_text().splitlines()[:100]:
            prompt = json.loads(line)["prompt"]
            answer = " ".join(reversed(prompt.lower().split()))
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    text = json.loads((tiny_kimi / "config.json").read_text())["text_config"]
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 192,
        "num_hidden_layers": 1, "vocab_size": text["vocab_size"], "draft_vocab_size": 200, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096, "hidden_act": "silu",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 4, 6]},
    }))
    out = tmp_path / "run"
    proc = run_cli(["run", f"--set=verifier.path={tiny_kimi}", f"--set=data.path={data}", "--set=data.regenerate=false",
                    "--set=extraction.backend=hf",
                    "--set=smoke.enabled=false", "--set=data.eval_fraction=0.25", "--set=data.max_seq_len=256",
                    "--set=training.epochs=1", f"--set=draft.like={reference}", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["verifier"]["nested_text_config"] is True and report["verifier"]["num_layers"] == 8
    assert report["tasks"]["extract-hidden-states"]["state"] == "Completed"

    draft = out / "draft"
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["vocab_size"] == text["vocab_size"] and cfg["target_hidden_size"] == text["hidden_size"] == 128
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]  # from the reference, within the 8 nested layers
    assert cfg["head_dim"] == 64 and cfg["intermediate_size"] == 192 and cfg["draft_vocab_size"] == 200
    assert cfg["rope_theta"] == 1000000.0
    assert cfg["bos_token_id"] == text["bos_token_id"] and cfg["eos_token_id"] == text["eos_token_id"]
    shapes = {k: v[0] for k, v in tensor_meta(draft).items()}
    assert {k: v for k, v in shapes.items() if k != "d2t"} == expected_shapes(json.loads(reference.read_text()) | {
        "target_hidden_size": 128, "num_aux_hidden_states": 3}, "layers.0")
    assert validate(draft, str(tiny_kimi)).problems == []
    hs = load_file(Path(report["artifacts"]["hidden_states"]) / "hidden_states" / "hs_0.safetensors")
    assert hs["hidden_states"].shape[1:] == (4, 128)  # three aux layers + the last, at the nested hidden size
