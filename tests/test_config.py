"""The one parameter model: YAML, --set overrides, and validation before any work."""

import os
import subprocess
import sys

import pytest

from deployments.stack import prefect_defaults
from eaglet.config import RunConfig, load_config
from eaglet.drafts import registry
from eaglet.errors import EagletError
from tests.conftest import ROOT


def test_defaults_and_overrides(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("training:\n  epochs: 2\ndraft:\n  draft_vocab_size: 1024\n")
    cfg = load_config(cfg_file, ["training.lr=0.01", "verifier.aux_layer_ids=[1, 5, 9]", "data.path=/x.jsonl"])
    assert cfg.training.epochs == 2 and cfg.training.lr == 0.01
    assert cfg.draft.draft_vocab_size == 1024
    assert cfg.verifier.aux_layer_ids == [1, 5, 9]
    assert cfg.data.path == "/x.jsonl"
    assert load_config().model_dump() == RunConfig().model_dump()
    # several capture servers: comma-separated with --set, a list in YAML
    assert load_config(None, ["verifier.endpoint=http://a:8000, http://b:8000"]).verifier.endpoint == [
        "http://a:8000", "http://b:8000"]
    cfg_file.write_text("verifier:\n  endpoint: [http://a:8000, http://b:8000/v]\n")
    assert load_config(cfg_file).verifier.endpoint == ["http://a:8000", "http://b:8000/v"]


@pytest.mark.parametrize("override, message", [
    ("training.epochs=0", "training.epochs"),
    ("training.nope=1", "training.nope"),
    ("verifier.aux_layer_ids=[2, 2, 5]", "duplicates"),
    ("verifier.aux_layer_ids=[-1, 2, 5]", "negative"),
    ("smoke.num_speculative_tokens=99", "smoke.num_speculative_tokens"),
    ("epochs", "not key=value"),
    ("training.loss=kl", "Unknown loss function 'kl'"),
    ("data.responses_per_prompt=2", "repeat the same greedy answer"),
    ('training.loss={"ce": 0.5, "nope": 0.5}', "Unknown loss function 'nope'"),
    ("verifier.endpoint=http://a:8000,gpu-host:8000", "verifier.endpoint.1"),
    ("extraction.data_parallel_size=0", "extraction.data_parallel_size"),
])
def test_invalid_parameters_are_one_clear_sentence(override, message):
    with pytest.raises(EagletError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, message", [
    (["training.loss=kl_div"], "dflash.position_weight=dpace needs training.loss=ce"),
    (["smoke.num_speculative_tokens=4"], "more than a DFlash block of 4 can draft (3)"),
    (["draft.like=/drafts/kimi"], "draft.like (a reference draft's shapes) does not apply to dflash drafts"),
])
def test_dflash_settings_that_do_not_fit_are_one_sentence(overrides, message):
    """The architecture checks its own settings (eaglet.registry.for_run: the CLI and resolve-verifier, before any
    load); the same settings are fine for eagle3."""
    with pytest.raises(EagletError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        registry.for_run(load_config(None, ["draft.architecture=dflash", *overrides]))
    assert "\n" not in str(e.value) and "Value error" not in str(e.value)
    registry.for_run(load_config(None, overrides[:1] if "like" not in overrides[0] else []))


def test_an_unknown_architecture_is_one_sentence():
    with pytest.raises(EagletError, match="draft.architecture='medusa' is not a draft architecture eaglet knows: use one of eagle3, dflash"):
        registry.for_run(load_config(None, ["draft.architecture=medusa"]))


def test_empty_defaults_resolve_per_architecture():
    eagle3, dflash = load_config(), load_config(None, ["draft.architecture=dflash", "dflash.block_size=8"])
    assert [(registry.for_run(c).loss(c), registry.for_run(c).k(c)) for c in (eagle3, dflash)] == [("kl_div", 3), ("ce", 7)]


def test_every_field_is_described():
    def walk(model):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, RunConfig.__mro__[1]) and ann is not RunConfig:
                yield from walk(ann)
            else:
                yield name, field
    for section in RunConfig.model_fields.values():
        for name, field in walk(section.annotation):
            assert field.description, f"{section.annotation.__name__}.{name} has no description"


def test_loss_takes_a_name_or_a_weighted_mix_and_reaches_speculators(tmp_path):
    from eaglet.train.launch import speculators_argv

    for value, spec in (("ce", "ce"), ('{"tv": 0.9, "ce": 0.1}', '{"ce": 0.1, "tv": 0.9}')):
        cfg = load_config(None, [f"training.loss={value}", "training.ttt_step_loss_decay=0.8"])
        argv = speculators_argv(registry.for_run(cfg), cfg, "/v", tmp_path, tmp_path, tmp_path, [1, 2, 3])
        assert argv[argv.index("--loss-fn") + 1] == spec
        assert argv[argv.index("--ttt-step-loss-decay") + 1] == "0.8"


def test_eaglet_processes_give_the_temporary_server_time_to_start():
    """`eaglet run` starts Prefect's temporary server, which must migrate a fresh SQLite database first: Prefect's
    20 s ran out on a busy 2-core CI machine. The default eaglet sets must be the one Prefect reads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_SERVER_EPHEMERAL")}
    code = ("from deployments.cli import _prefect_env; _prefect_env(); "
            "from prefect.settings import get_current_settings as s; "
            "print(s().server.ephemeral.startup_timeout_seconds)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) == int(prefect_defaults()["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"])


def test_an_engine_eaglet_starts_can_answer_the_smoke_baseline_when_training_answers_are_shorter():
    """With data.max_new_tokens below smoke.max_tokens, the capture engine used to be too short for the held-out
    answers, and the smoke test loaded the verifier once more (a run of 2,081 prompts x 48 tokens, 2026-12-02)."""
    from eaglet.capture.engine import Engine
    from eaglet.capture.engine import baseline_engine_fits, engine_max_model_len, started_engine_max_model_len

    sets = ["data.max_new_tokens=48", "smoke.max_tokens=128", "smoke.dtype=float32",
            "extraction.engine_dtype=float32"]
    cfg = load_config(None, sets)
    started = Engine(endpoint="http://x", served_name="x", max_model_len=started_engine_max_model_len(cfg))
    assert baseline_engine_fits([started], cfg)
    assert engine_max_model_len(cfg) == 1024 + 48  # a served engine is still only required to fit the data
    served = Engine(endpoint="http://x", served_name="x", max_model_len=engine_max_model_len(cfg))
    assert not baseline_engine_fits([served], cfg)  # ... and then the smoke test answers with an engine of its own
    assert not baseline_engine_fits([started, served], cfg)  # the shortest engine of a fleet decides
    long_answers = load_config(None, ["data.max_new_tokens=256"])
    assert started_engine_max_model_len(long_answers) == 1024 + 256


def test_cpu_training_dtype_auto_follows_this_cpus_measured_bf16_speed(monkeypatch):
    """training.cpu_dtype=auto: bf16 only where bf16 matmuls are measured at least BF16_MIN_SPEEDUP times float32's;
    measured once per process, so every cache key and the argv of one run agree."""
    import eaglet.train.launch as launch

    speedup = launch.bf16_matmul_speedup()
    assert launch.bf16_matmul_speedup() == speedup  # not measured again
    for measured, chosen in ((launch.BF16_MIN_SPEEDUP - 0.01, "float32"), (launch.BF16_MIN_SPEEDUP, "bfloat16")):
        monkeypatch.setattr(launch, "bf16_matmul_speedup", lambda m=measured: m)
        assert launch.cpu_dtype("auto") == chosen
    assert (launch.cpu_dtype("float32"), launch.cpu_dtype("bfloat16")) == ("float32", "bfloat16")