"""Nothing in the cache is reused with different inputs: every parameter that can change an artifact changes
the key of the artifacts it affects, and each parameter that does not is listed here with the reason."""

import json
import typing
from pathlib import Path

import pytest

from eaglet.capture.rows import row_key
from eaglet.config import RunConfig
from eaglet.data import write_conversations
from eaglet.train.launch import cpu_dtype
from eaglet.verifier import VerifierInfo
from eaglet.capture import run_backend
from eaglet.capture.engine import capture_engine_dtype
from eaglet.capture.vllm import run_capture_settings
from eaglet import keys as key_fns

# Parameters that reach the artifacts another way, or change how they are computed and not what they are.
NOT_IN_KEYS = {
    "verifier.path": "enters as the verifier's content fingerprint (test_verifier_identity_is_in_every_key)",
    "verifier.trust_remote_code": "allows loading; the fingerprint covers the config and files that decide the model",
    "verifier.aux_layer_ids": "enters resolved, as VerifierInfo.aux_layer_ids (test_verifier_identity_is_in_every_key)",
    "data.path": "enters as its rows' content (test_data_file_content_is_in_the_key)",
    "data.eval_path": "enters as its rows' content (test_fixed_eval_file_is_in_the_data_key)",
    "training.init": "enters resolved, as the warm start's identity (test_warm_start_is_in_the_training_key)",
    "training.warm_epochs": "enters as the epochs trained, when there is a warm start "
                            "(test_warm_start_is_in_the_training_key)",
    "training.warm_lr_fraction": "enters as the learning rate a warm start trains at "
                                  "(test_warm_start_levers_are_in_the_training_key)",
    "training.warm_warmup_steps": "enters as the warm-up a warm start trains with "
                                  "(test_warm_start_levers_are_in_the_training_key)",
    "training.warm_replay_fraction": "enters when a warm start trains on part of the rows "
                                     "(test_warm_start_levers_are_in_the_training_key)",
    "smoke.min_acceptance": "a gate on the smoke result, not a part of it: a stricter gate re-judges a cached result",
    "extraction.backend": "enters resolved ('auto' is hf or vllm), as its extractor version "
                          "(test_extraction_backend_is_in_the_key)",
    "verifier.endpoint": "where the data pass runs, not what: the endpoint must serve verifier.path's fingerprint "
                         "and the run's layers (test_capture_vllm.py)",
    "smoke.load_format": "how vLLM reads the weights, not which weights",
    "extraction.tensor_parallel_size": "how many GPUs, not what: vLLM's ranks compute the same layers",
    "extraction.data_parallel_size": "how many engines, not what: each row is keyed on its own, whichever engine "
    "answers it (test_capture_vllm.py)",
    "extraction.batch_size": "how, not what: padding is masked out of every state (and an out-of-memory retry "
                             "halves it for the same artifact)",
    "extraction.device": "where, not what",
    "extraction.workers": "how many, not what: the shards' files are the same (test_distributed.py)",
    "extraction.scheduler_address": "where, not what",
    "draft.like": "enters as the reference's content (test_reference_content_is_in_the_training_key)",
    "eval.enabled": "whether the serving evaluation runs, not what it measures",
    "eval.target_concurrency": "a gate on the evaluation's figures (a target outside eval.concurrency is measured "
                               "too, as a level: eval.concurrency's entry covers the levels)",
    "smoke.min_speedup": "a gate on the evaluation's figures: a stricter gate re-judges a cached evaluation",
}


def _chain(cfg: RunConfig, verifier: VerifierInfo, data_file: str, init: str | None = None) -> dict[str, str]:
    """Every artifact key of a run, each built from its upstream artifact's key as the flow does (the data
    artifact is written for real, beside the data file: the smoke keys read its held-out prompts)."""
    keys = {"data": key_fns.data_key(data_file, cfg)}
    data_dir = Path(data_file).parent / keys["data"]
    if not data_dir.is_dir():
        data_dir.mkdir()
        write_conversations(data_dir / "eval.jsonl", key_fns.run_rows(data_file, cfg)[1])
    keys["data"] = str(data_dir)
    if run_backend(cfg) == "vllm":  # one pass: responses and states in one artifact
        keys["hidden_states"] = key_fns.capture_key(verifier, keys["data"], cfg)
        # ... assembled from row artifacts, each keyed on its own: the key one request's row would have
        keys["row"] = row_key(verifier.fingerprint, run_capture_settings(verifier, cfg), {"prompt_ids": [1, 2]})
    else:
        conversations = keys["data"]
        if cfg.data.regenerate:
            keys["responses"] = conversations = key_fns.regen_key(verifier, keys["data"], cfg)
        keys["hidden_states"] = key_fns.extraction_key(verifier, conversations, cfg)
    keys["vocab"] = key_fns.vocab_key(verifier, keys["hidden_states"], init, cfg)
    keys["draft_ckpt"] = key_fns.training_key(verifier, keys["hidden_states"], keys["vocab"], init, cfg)
    keys["draft_flat"] = key_fns.export_key(verifier, keys["draft_ckpt"], cfg)
    keys["baseline"] = key_fns.baseline_key(verifier, keys["data"], cfg)
    keys["smoke"] = key_fns.smoke_key(verifier, keys["draft_flat"], keys["data"], keys["baseline"], cfg)
    keys["serving_baseline"] = key_fns.serving_baseline_key(verifier, cfg)
    keys["evaluation"] = key_fns.evaluation_key(verifier, keys["draft_flat"], keys["draft_ckpt"],
                                                keys["serving_baseline"], cfg, keys["data"])
    keys["smoke_on_evaluation"] = key_fns.smoke_key(verifier, keys["draft_flat"], keys["data"], keys["baseline"], cfg,
                                                    keys["evaluation"])
    return keys


def _leaves() -> list[str]:
    return [f"{section}.{name}" for section, sfield in RunConfig.model_fields.items()
            for name in sfield.annotation.model_fields]


# Parameters that change the artifacts they affect: each one, perturbed, must change some artifact key. Every
# RunConfig field is here or in NOT_IN_KEYS (test_every_parameter_is_placed): a new field must be placed.
IN_KEYS = [
    "data.max_seq_len", "data.eval_fraction", "data.max_samples", "data.regenerate", "data.max_new_tokens",
    "data.temperature", "data.responses_per_prompt", "data.seed", "data.regenerate_turns", "data.chat_template_kwargs",
    "data.reasoning_tags", "data.reasoning_in_loss",
    "extraction.engine_dtype", "extraction.dtype", "extraction.states", "extraction.disk_budget_gb",
    "draft.architecture", "draft.draft_vocab_size", "draft.norm_before_residual", "draft.norm_before_fc",
    "draft.norm_output",
    # perturbed on a dflash run (test_every_parameter_changes_the_keys_it_affects); on an eagle3 run they are in no
    # key (test_other_architectures_settings_leave_eagle3_keys_alone)
    "dflash.block_size", "dflash.num_layers", "dflash.max_anchors", "dflash.position_weight", "dflash.decay_gamma",
    "dflash.mask_token_id",
    "training.epochs", "training.lr", "training.optimizer", "training.scheduler", "training.warmup_steps",
    "training.ttt_steps", "training.total_seq_len", "training.seed", "training.cpu_dtype", "training.loss",
    "training.ttt_step_loss_decay",
    "export.layer_prefix", "export.serving_id", "export.keep_embeddings",
    "smoke.enabled", "smoke.num_speculative_tokens", "smoke.max_tokens", "smoke.num_prompts", "smoke.dtype",
    "eval.suites", "eval.prompts_per_suite", "eval.max_tokens", "eval.concurrency", "eval.k",
]


# 'auto' settings enter the keys resolved on this machine (test_auto_dtypes_enter_resolved)
AUTO_RESOLVED = {
    "training.cpu_dtype": lambda cfg: cpu_dtype(cfg.training.cpu_dtype),
    "extraction.engine_dtype": lambda cfg: capture_engine_dtype(cfg),
}
OTHER_VALUE = {"training.loss": "ce", "extraction.disk_budget_gb": 2.5,  # valid values of free-form fields
               "data.chat_template_kwargs": {"enable_thinking": True}, "data.reasoning_tags": ("<t>", "</t>"),
               "draft.architecture": "dflash", "dflash.num_layers": 2,
               "eval.suites": ["math"], "eval.concurrency": [1, 2], "eval.k": [1]}


def _other_value(model, name, value, where=""):
    if where in OTHER_VALUE:
        return OTHER_VALUE[where]
    field = type(model).model_fields[name]
    ann = field.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is typing.Literal:
        same = AUTO_RESOLVED[where](RunConfig()) if value == "auto" else value  # 'auto' is its resolved value
        return next(v for v in typing.get_args(ann) if v not in (value, same))
    if ann is bool:
        return not value
    if ann is int or int in args:
        bounds = {type(m).__name__: m for m in field.metadata}
        up = value + 1 if value is not None else 5
        return up if "Le" not in bounds or up <= bounds["Le"].le else value - 1
    if ann is float:
        return value / 2 if value else 0.5
    if ann is str or str in args:
        return "acme/other"
    raise AssertionError(f"no perturbation for {name}: {ann}")


@pytest.fixture
def verifier():
    return VerifierInfo(path="/v", fingerprint="f" * 16, model_type="llama", num_layers=8, hidden_size=128,
                        vocab_size=2256, aux_layer_ids=[2, 4, 5])


@pytest.fixture
def data_file(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(400)))
    return str(f)


def test_every_parameter_is_placed():
    """Each RunConfig field is either tested to change the keys (IN_KEYS) or excluded with its reason
    (NOT_IN_KEYS), never both, never neither."""
    leaves = _leaves()
    assert len(IN_KEYS) == len(set(IN_KEYS)), "a field listed twice in IN_KEYS"
    assert not set(IN_KEYS) & set(NOT_IN_KEYS), set(IN_KEYS) & set(NOT_IN_KEYS)
    assert set(IN_KEYS) | set(NOT_IN_KEYS) == set(leaves), {
        "unplaced (add to IN_KEYS or NOT_IN_KEYS)": sorted(set(leaves) - set(IN_KEYS) - set(NOT_IN_KEYS)),
        "not a field": sorted((set(IN_KEYS) | set(NOT_IN_KEYS)) - set(leaves))}
    for where, reason in NOT_IN_KEYS.items():
        assert isinstance(reason, str) and reason.strip(), f"{where}: excluded without a reason"


@pytest.mark.parametrize("where", IN_KEYS)
def test_every_parameter_changes_the_keys_it_affects(where, verifier, data_file):
    section, name = where.split(".")
    # rows held out by digest (data.eval_fraction); sampled answers only where more than one per prompt is
    # perturbed (more than one greedy answer per prompt is refused)
    sampled = {"temperature": 0.7} if name == "responses_per_prompt" else {}
    arch = {"draft": {"architecture": "dflash"}, "training": {"loss": "ce"}} if section == "dflash" else {}
    base = RunConfig.model_validate({"data": {"path": data_file, **sampled}, **arch})
    sec = getattr(base, section)
    other = _other_value(sec, name, getattr(sec, name), where)
    changed = base.model_copy(update={section: sec.model_copy(update={name: other})})
    RunConfig.model_validate(changed.model_dump())  # the perturbed value is a valid parameter
    before, after = _chain(base, verifier, data_file), _chain(changed, verifier, data_file)
    assert before != after, f"{where} changes no artifact key"


def test_other_architectures_settings_leave_eagle3_keys_alone(verifier, data_file):
    """An eagle3 run's keys are those of drafts trained before eaglet had a second architecture, whatever the
    dflash section says; the resolved defaults (loss, k) are the same artifacts as the explicit values."""
    base = RunConfig.model_validate({"data": {"path": data_file}})
    other = RunConfig.model_validate({"data": {"path": data_file}, "dflash": {"block_size": 8, "num_layers": 3}})
    explicit = RunConfig.model_validate({"data": {"path": data_file}, "training": {"loss": "kl_div"},
                                         "smoke": {"num_speculative_tokens": 3}})
    assert _chain(base, verifier, data_file) == _chain(other, verifier, data_file) == \
        _chain(explicit, verifier, data_file)
    dflash = _chain(RunConfig.model_validate({"data": {"path": data_file}, "draft": {"architecture": "dflash"}}),
                    verifier, data_file)
    same_rows = ("data", "hidden_states", "row", "vocab", "baseline")  # one capture feeds both architectures
    assert all(dflash[k] == _chain(base, verifier, data_file)[k] for k in same_rows)


@pytest.mark.parametrize("where", sorted(AUTO_RESOLVED))
def test_auto_dtypes_enter_resolved(where, verifier, data_file):
    """'auto' and the value it resolves to on this machine are the same artifacts."""
    section, name = where.split(".")
    resolved = AUTO_RESOLVED[where](RunConfig())
    assert resolved in ("bfloat16", "float32")
    base = RunConfig.model_validate({"data": {"path": data_file}})
    explicit = base.model_copy(update={section: getattr(base, section).model_copy(update={name: resolved})})
    assert _chain(base, verifier, data_file) == _chain(explicit, verifier, data_file)


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_verifier_identity_is_in_every_key(backend, verifier, data_file):
    """Rows too: through 2026-12-02 a row's key had the count of its layers, not which, and a run with aux
    [8, 15, 27] trained on the rows an earlier run captured for [2, 15, 29] (and measured 1.544 instead of 1.6)."""
    cfg = RunConfig.model_validate({"extraction": {"backend": backend}})
    base = _chain(cfg, verifier, data_file)
    assert ("row" in base) == (backend == "vllm")
    for update in ({"fingerprint": "0" * 16}, {"aux_layer_ids": [1, 4, 6]}):
        other = _chain(cfg, verifier.model_copy(update=update), data_file)
        for kind in ("hidden_states", "vocab", "draft_ckpt", "draft_flat", "smoke") + ("row",) * ("row" in base):
            assert other[kind] != base[kind], (update, kind)
        # the verifier alone does not depend on which layers the draft reads
        assert (other["baseline"] != base["baseline"]) == ("fingerprint" in update), update


def test_data_file_content_is_in_the_key(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a"}\n')
    k1 = key_fns.data_key(str(f), RunConfig())
    f.write_text('{"prompt": "b"}\n')
    assert key_fns.data_key(str(f), RunConfig()) != k1


def test_fixed_eval_file_is_in_the_data_key(tmp_path, data_file):
    f = tmp_path / "eval.jsonl"
    f.write_text('{"prompt": "question 1"}\n')
    cfg = RunConfig.model_validate({"data": {"path": data_file, "eval_path": str(f)}})
    k1 = key_fns.data_key(data_file, cfg)
    f.write_text('{"prompt": "question 2"}\n')
    assert key_fns.data_key(data_file, cfg) != k1
    moved = tmp_path / "moved.jsonl"
    moved.write_text(f.read_text())
    same = RunConfig.model_validate({"data": {"path": data_file, "eval_path": str(moved)}})
    assert key_fns.data_key(data_file, same) == key_fns.data_key(data_file, cfg)


def test_warm_start_is_in_the_training_key(tmp_path, verifier, data_file):
    cfg = RunConfig.model_validate({"training": {"init": "previous", "warm_epochs": 1}})
    scratch = _chain(cfg, verifier, data_file)  # 'previous' found nothing: from scratch, training.epochs
    warm = _chain(cfg, verifier, data_file, init="/store/draft_ckpt/aaaa")
    other = _chain(cfg, verifier, data_file, init="/store/draft_ckpt/bbbb")
    assert len({scratch["vocab"], warm["vocab"], other["vocab"]}) == 3  # a warm start keeps its own vocabulary
    assert len({scratch["draft_ckpt"], warm["draft_ckpt"], other["draft_ckpt"]}) == 3
    three = cfg.model_copy(update={"training": cfg.training.model_copy(update={"warm_epochs": 3})})
    assert _chain(three, verifier, data_file, init="/store/draft_ckpt/aaaa")["draft_ckpt"] != warm["draft_ckpt"]
    assert _chain(three, verifier, data_file)["draft_ckpt"] == scratch["draft_ckpt"]  # not warm: epochs rule


@pytest.mark.parametrize("lever,value", [("warm_lr_fraction", 0.25), ("warm_warmup_steps", 0),
                                         ("warm_replay_fraction", 0.5), ("warm_epochs", 2)])
def test_warm_start_levers_are_in_the_training_key(lever, value, verifier, data_file):
    """Each lever changes a warm start's draft and nothing else: not a scratch run's key, not the vocabulary."""
    base = RunConfig.model_validate({"training": {"init": "previous", "warm_epochs": 1}})
    changed = base.model_copy(update={"training": base.training.model_copy(update={lever: value})})
    warm = "/store/draft_ckpt/aaaa"
    assert _chain(changed, verifier, data_file, init=warm)["draft_ckpt"] != \
        _chain(base, verifier, data_file, init=warm)["draft_ckpt"]
    assert _chain(changed, verifier, data_file, init=warm)["vocab"] == _chain(base, verifier, data_file, init=warm)["vocab"]
    assert _chain(changed, verifier, data_file)["draft_ckpt"] == _chain(base, verifier, data_file)["draft_ckpt"]


def test_reference_content_is_in_the_training_key(tmp_path, verifier, data_file):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 256,
                               "vocab_size": 2256, "head_dim": 64}))
    cfg = RunConfig.model_validate({"draft": {"like": str(ref)}})
    k1 = _chain(cfg, verifier, data_file)["draft_ckpt"]
    ref.write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 2, "intermediate_size": 512,
                               "vocab_size": 2256, "head_dim": 64}))
    assert _chain(cfg, verifier, data_file)["draft_ckpt"] != k1
    moved = tmp_path / "moved.json"
    moved.write_text(ref.read_text())
    same = RunConfig.model_validate({"draft": {"like": str(moved)}})
    assert _chain(same, verifier, data_file)["draft_ckpt"] == _chain(cfg, verifier, data_file)["draft_ckpt"]


def test_extraction_backend_is_in_the_key(verifier, data_file):
    def keys(backend: str) -> dict[str, str]:
        return _chain(RunConfig.model_validate({"extraction": {"backend": backend}}), verifier, data_file)

    hf, vllm, auto = keys("hf"), keys("vllm"), keys("auto")
    assert hf["hidden_states"] != vllm["hidden_states"]  # the backends agree to bf16 rounding, not bit for bit
    assert hf["draft_ckpt"] != vllm["draft_ckpt"] and Path(hf["data"]).name == Path(vllm["data"]).name
    assert auto == vllm  # auto is vllm wherever vLLM is installed (CPU included) and reuses its artifacts


@pytest.mark.parametrize("sets", [{"states": "stream"}, {"disk_budget_gb": 0.5}])
def test_streamed_states_are_a_view_of_their_own_and_the_same_draft(sets, verifier, data_file, tmp_path, monkeypatch):
    """A view with streamed samples links fewer files than the kept view: a key of its own. What training reads
    is the same content, so once the view records the kept view's key (rows.json `content`), vocabulary and
    draft are keyed as for the kept view: either run reuses the other's draft."""
    monkeypatch.chdir(tmp_path)
    keep = RunConfig.model_validate({"data": {"path": data_file}})
    streamed = keep.model_copy(update={"extraction": keep.extraction.model_copy(update=sets)})
    a, b = _chain(keep, verifier, data_file), _chain(streamed, verifier, data_file)
    assert a["hidden_states"] != b["hidden_states"] and a["row"] == b["row"]
    assert key_fns.capture_content_key(verifier, a["data"], streamed) == a["hidden_states"]
    view = tmp_path / b["hidden_states"]  # the streamed view, as the flow publishes it (a path named by its key)
    view.mkdir()
    (view / "rows.json").write_text(json.dumps({"rows": ["r"], "computed": [], "streamed": ["r"],
                                                "content": a["hidden_states"]}))
    vocab = key_fns.vocab_key(verifier, str(view), None, streamed)
    assert vocab == a["vocab"]
    assert key_fns.training_key(verifier, str(view), vocab, None, streamed) == a["draft_ckpt"]
