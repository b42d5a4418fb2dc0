"""scripts/gpu_check.sh kept working where no GPU is lent: the same steps with --allow-cpu (vLLM's CPU backend,
CPU training settings) at the smallest sizes that still run each step (the session's tiny verifier, 8 training
conversations, 4 held-out prompts, 16 tokens, one epoch), and the clear refusal without it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def _gpu_check(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def test_without_a_gpu_it_says_so(tmp_path):
    proc = _gpu_check(str(tmp_path / "out"))
    assert proc.returncode == 1 and "sees no CUDA device" in proc.stderr, proc.stderr[-2000:]


def test_every_step_runs_on_cpu(tiny_verifier, tmp_path):
    out = tmp_path / "out"
    # step 6, the serving evaluation, is eaglet.evaluate.serving: tests/test_serving_e2e.py runs it
    proc = _gpu_check(str(out), "--allow-cpu", "--verifier", str(tiny_verifier), "--samples", "8",
                      "--eval-prompts", "4", "--max-tokens", "16", "--epochs", "1", "--no-eval")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["environment"]["cuda"] is False
    assert summary["sizes"] == {"samples": 8, "eval_prompts": 4, "max_tokens": 16, "epochs": 1}
    compared = summary["hf_vs_vllm"]
    assert compared["files"] == summary["extract_hf"]["samples"] == summary["extract_vllm"]["samples"] > 0
    assert compared["cosine_min"] > 0.999 and len(compared["cosine_min_per_layer"]) == 4  # 3 aux + last
    assert summary["smoke"]["lossless"] and summary["smoke"]["drafts"] > 0
    assert "--draft-attn-impl" in summary["training"]["argv"]  # the CPU settings; a GPU gets speculators' defaults
    assert summary["one_pass"]["mode"] == "generate+capture" and summary["one_pass"]["generated_tokens"] > 0
    assert set(summary["seconds"]) >= {"verifier engine (vLLM)", "generate and capture (one vLLM pass)",
                                       "capture prefill (vLLM)", "vLLM smoke-load"}
