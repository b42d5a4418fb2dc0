"""The multi-GPU training launch, as far as a CPU machine can take it: the command and environment, the FSDP
flag, and a real torchrun of 2 ranks that reach speculators' distributed set-up (which needs an accelerator)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from eaglet.config import RunConfig
from eaglet.drafts import registry
from eaglet.train.launch import speculators_argv, torchrun_argv, torchrun_command, torchrun_env, train_draft
from eaglet.train.metrics import follow_metrics, metrics_end


def test_torchrun_command_runs_one_eaglet_rank_per_gpu(tmp_path):
    cmd = torchrun_command(tmp_path / "argv.json", tmp_path / "metrics.jsonl", 8)
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
                   "-m", "eaglet.train.rank", str(tmp_path / "argv.json"), str(tmp_path / "metrics.jsonl")]
    assert torchrun_argv(["--epochs", "3"]) == ["--epochs", "3", "--fsdp-shard"]
    assert torchrun_argv(["--fsdp-shard"]) == ["--fsdp-shard"]


def test_the_ranks_share_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert torchrun_env(2)["OMP_NUM_THREADS"] == "8"


def test_more_than_one_visible_gpu_trains_under_torchrun(monkeypatch, tmp_path):
    """The launcher's choice, whatever this machine has: one rank per visible GPU from two on."""
    import eaglet.train.launch as launch

    calls = []
    monkeypatch.setattr(launch, "visible_accelerators", lambda: 4)
    monkeypatch.setattr(launch, "_train_with_torchrun", lambda argv, m, on, nproc, stream: calls.append(nproc))
    train_draft(["--save-path", str(tmp_path)], tmp_path / "metrics.jsonl")
    assert calls == [4]


@pytest.mark.e2e  # two ranks of speculators under torchrun
def test_two_ranks_start_under_torchrun_and_reach_speculators(tiny_verifier, tmp_path):
    save = tmp_path / "work" / "checkpoints"
    cfg = RunConfig()
    # The ranks stop in speculators' set-up, before any data is read: the paths need not exist.
    argv = speculators_argv(registry.for_run(cfg), cfg, str(tiny_verifier), tmp_path / "states", tmp_path / "vocab",
                            save, [2, 4, 5])
    with pytest.raises(RuntimeError) as err:
        train_draft(argv, tmp_path / "work" / "metrics.jsonl", lambda row: None, nproc=2)
    text = str(err.value)
    assert "torchrun (2 ranks) failed" in text
    # both ranks ran eaglet.train.rank into speculators' maybe_setup_distributed -> set_device_index
    assert text.count("Cannot access accelerator device when none is available") >= 2, text[-2000:]
    launched = json.loads((tmp_path / "work" / "torchrun_argv.json").read_text())
    assert launched == argv + ["--fsdp-shard"] and Path(launched[launched.index("--save-path") + 1]) == save


def test_a_resumed_run_reports_only_new_metrics(tmp_path):
    """The parent follows the file rank 0 appends to; rows from the attempt before the resume are not repeated,
    and a half-written line waits until it is whole."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"kind": "val", "epoch": 0}) + "\n")  # the earlier attempt's epoch
    seen, stop = [], threading.Event()
    follower = threading.Thread(target=follow_metrics, args=(path, seen.append, stop, metrics_end(path), 0.05))
    follower.start()
    with open(path, "a") as f:
        f.write(json.dumps({"kind": "train", "epoch": 1, "step": 7}) + "\n" + '{"kind": "val", ')
        f.flush()
        time.sleep(0.3)
        assert seen == [{"kind": "train", "epoch": 1, "step": 7}]
        f.write('"epoch": 1}\n')
    stop.set()
    follower.join()
    assert seen == [{"kind": "train", "epoch": 1, "step": 7}, {"kind": "val", "epoch": 1}]


def test_float32_muon_is_upstreams_orthogonalisation_unrounded():
    """eaglet.train.float32_muon swaps torch's bf16 Newton-Schulz for the same iteration in float32 (CPUs without
    AMX): equal up to bf16 rounding, for wide and tall matrices, and restored afterwards."""
    import torch
    import torch.optim._muon as muon

    from eaglet.train.cpu import float32_muon

    upstream = muon._zeropower_via_newtonschulz
    for shape in ((64, 160), (160, 64)):
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        want = upstream(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        with float32_muon():
            got = muon._zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert (got - want).norm() < 0.02 * want.norm()  # bf16 keeps 8 bits: ~1% apart
    assert muon._zeropower_via_newtonschulz is upstream


def test_the_draft_is_the_epoch_validation_predicts_best(tmp_path):
    from eaglet.train.checkpoints import best_checkpoint

    ckpts = tmp_path / "checkpoints"
    for e in range(3):
        (ckpts / str(e)).mkdir(parents=True)
        (ckpts / str(e) / "config.json").write_text("{}")
        (ckpts / str(e) / "model.safetensors").write_text("")
    rows = [{"kind": "val", "epoch": e, "metrics": {"full_acc_0_epoch": a, "full_acc_1_epoch": a / 2}}
            for e, a in ((0, 0.3), (1, 0.5), (2, 0.4))]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert best_checkpoint(ckpts, metrics, registry.get("eagle3").score) == (ckpts / "1", 1.75)
    metrics.write_text("")  # no validation recorded: the last epoch
    assert best_checkpoint(ckpts, metrics, registry.get("eagle3").score) == (ckpts / "2", None)


def test_a_warm_start_loads_the_epoch_the_draft_was_delivered_from(tmp_path):
    from eaglet.report import validation_acceptance
    from eaglet.train.checkpoints import read_delivered, write_delivered
    from eaglet.train.warm_start import warm_start_weights

    draft = tmp_path / "draft"
    for e in range(3):
        (draft / "checkpoints" / str(e)).mkdir(parents=True)
        (draft / "checkpoints" / str(e) / "model.safetensors").write_text("")
        (draft / "checkpoints" / str(e) / "config.json").write_text("{}")
    assert read_delivered(draft) is None and warm_start_weights(draft) == draft / "checkpoints" / "2"  # older drafts
    write_delivered(draft, draft / "checkpoints" / "1", 1.75)
    assert read_delivered(draft) == {"epoch": 1, "predicted": 1.75}
    assert validation_acceptance(draft, registry.get("eagle3")) == 1.75
    assert warm_start_weights(draft) == draft / "checkpoints" / "1"


def test_decoding_walks_from_where_the_last_step_ended():
    """eaglet.drafts.eagle3.acceptance.walk: a step from j accepts the run of right steps (steps after a wrong one do not count)
    and the next step starts at j + run + 1; positions outside the response are never starts."""
    import torch

    from eaglet.drafts.eagle3.acceptance import walk

    right = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 0],   # step 0 right from j
                          [1, 0, 0, 0, 1, 1, 0, 0],   # step 1
                          [0, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    # starts: 1 (run 1: step 1 wrong) -> 3 (run 1) -> 5 (run 3) -> 9 > last
    assert walk(right, mask) == [1, 1, 3]
    assert walk(right, torch.zeros(8, dtype=torch.bool)) == []
