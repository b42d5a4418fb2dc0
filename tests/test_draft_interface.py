"""A third draft architecture is one new class registered by this test and nothing else: keys, export, validation,
the CLI's validate and speculators' argv all reach it through eaglet.drafts' interface. No engine, no flow."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from deployments.cli import main as eaglet
from eaglet import keys
from eaglet.config import ExportParams, RunConfig, load_config
from eaglet.drafts import registry
from eaglet.drafts.checkpoint import read_config, write_json
from eaglet.errors import EagletError
from eaglet.train.argv import argv_value
from eaglet.train.launch import speculators_argv
from eaglet.verifier import VerifierInfo


class Medusa(registry.DraftArchitecture):
    """A stand-in architecture: its export writes its own config, its validation checks one field."""

    name = "medusa_test"
    method = "medusa"
    default_loss = "ce"
    export_kind = "draft_medusa_test"
    export_version = "medusa-1"
    served_form = "a test draft"
    score_meaning = "1 + heads right"

    def default_k(self, cfg: RunConfig) -> int:
        return 2

    def max_k(self, cfg: RunConfig) -> int:
        return 4

    def speculators_args(self, cfg: RunConfig) -> list[str]:
        return ["--speculator-type", "medusa"]

    def shape_args(self, cfg: RunConfig) -> list[str]:
        return ["--num-layers", "1"]

    def score(self, val_metrics: Mapping[str, float]) -> float | None:
        return 1.0 + val_metrics.get("heads_right", 0.0)

    def owns(self, config: dict) -> bool:
        return config.get("speculators_model_type") == self.name

    def export(self, ckpt_dir: Path, out: Path, verifier: str, export: ExportParams) -> None:
        write_json(out / "config.json", {**read_config(ckpt_dir), "served_as": export.serving_id})
        self.validate(out, verifier).raise_problems(out)

    def validate(self, draft_dir: Path, verifier: str) -> registry.ValidationReport:
        report = registry.ValidationReport()
        if "heads" not in read_config(draft_dir):
            report.problems.append("heads is missing")
        return report


@pytest.fixture
def medusa():
    arch = registry.register(Medusa())
    yield arch
    del registry.ARCHITECTURES[arch.name]


def _verifier() -> VerifierInfo:
    return VerifierInfo(path="/v", fingerprint="f" * 16, model_type="llama", num_layers=8, hidden_size=128,
                        vocab_size=300, aux_layer_ids=[2, 4, 5])


def test_a_registered_architecture_is_reached_through_the_interface(medusa, tmp_path):
    cfg = load_config(None, ["draft.architecture=medusa_test"])
    assert registry.for_run(cfg) is medusa and (medusa.loss(cfg), medusa.k(cfg)) == ("ce", 2)

    argv = speculators_argv(medusa, cfg, "/v", tmp_path, tmp_path, tmp_path, [2, 4, 5])
    assert argv_value(argv, "--speculator-type") == "medusa" and argv_value(argv, "--loss-fn") == "ce"
    assert argv_value(argv, "--num-layers") == "1"

    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    ckpt.mkdir(), out.mkdir()
    write_json(ckpt / "config.json", {"speculators_model_type": "medusa_test", "heads": 3})
    medusa.export(ckpt, out, "/v", ExportParams(serving_id="org/model"))
    assert json.loads((out / "config.json").read_text())["served_as"] == "org/model"
    assert registry.of_checkpoint(out) is medusa and medusa.validate(out, "/v").ok
    assert eaglet(["validate", str(out), "--verifier", "/v"]) == 0

    write_json(out / "config.json", {"speculators_model_type": "medusa_test"})
    assert eaglet(["validate", str(out), "--verifier", "/v"]) == 1
    with pytest.raises(EagletError, match="heads is missing"):
        medusa.check_before_serving(out, "/v")

    # keys: its name, its export kind and version; the eagle3 keys are not touched
    v = _verifier()
    assert keys.draft_settings(cfg)["architecture"] == "medusa_test"
    assert keys.export_kind(v, str(ckpt), cfg) == "draft_medusa_test"
    default = RunConfig()
    assert keys.export_key(v, str(ckpt), cfg) != keys.export_key(v, str(ckpt), default)
    assert "architecture" not in keys.draft_settings(default)


def test_its_own_limits_are_one_sentence_before_any_load(medusa):
    with pytest.raises(EagletError, match=r"smoke.num_speculative_tokens=5 is more than a medusa_test draft"):
        registry.for_run(load_config(None, ["draft.architecture=medusa_test", "smoke.num_speculative_tokens=5"]))
    with pytest.raises(EagletError, match="draft.like .* does not apply to medusa_test drafts"):
        registry.for_run(load_config(None, ["draft.architecture=medusa_test", "draft.like=/x"]))
    with pytest.raises(EagletError, match="has no flat form|medusa_test drafts have no flat form"):
        medusa.flatten(Path("/a"), Path("/b"), None, ExportParams())


def test_a_name_taken_is_refused(medusa):
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Medusa())
