"""The work pool templates in deployments/work-pools/: what a flow run on a GPU host or a Kubernetes GPU node
gets, resolved by Prefect's own templating (the worker's code path). The server accepting them: test_stack.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from prefect.utilities.templating import apply_values
from prefect.workers.process import ProcessWorker

from tests.conftest import ROOT

POOLS = ROOT / "deployments" / "work-pools"


def _template(name: str) -> dict:
    return json.loads((POOLS / name).read_text())


def _defaults(template: dict) -> dict:
    return {k: v["default"] for k, v in template["variables"]["properties"].items() if "default" in v}


def test_process_gpu_pool_sets_the_visible_gpus_and_the_shared_store():
    template = _template("process-gpu.json")
    config = asyncio.run(ProcessWorker.job_configuration.from_template_and_values(
        template, {"gpus": "0,1,2,3,4,5,6,7", "eaglet_home": "/shared/eaglet"}))
    assert config.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert config.env["EAGLET_HOME"] == "/shared/eaglet"
    assert config.env["PREFECT_LOGGING_EXTRA_LOGGERS"] == "eaglet"
    unset = asyncio.run(ProcessWorker.job_configuration.from_template_and_values(template, {}))
    assert not {"CUDA_VISIBLE_DEVICES", "EAGLET_HOME", "HF_HOME"} & {k for k, v in unset.env.items() if v}


def test_kubernetes_gpu_pool_requests_gpus_shared_memory_and_the_store():
    template = _template("kubernetes-gpu.json")
    job = apply_values(template["job_configuration"], {**_defaults(template), "image": "registry/eaglet:cu128",
                                                       "store_claim": "eaglet-store", "name": "run"})
    pod = job["job_manifest"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8  # default: Kimi-K2.5 on one 8-GPU node
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert container["image"] == "registry/eaglet:cu128"
    assert job["env"]["EAGLET_HOME"] == "/shared/eaglet"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"eaglet-store": "/shared/eaglet", "dshm": "/dev/shm"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["eaglet-store"]["persistentVolumeClaim"]["claimName"] == "eaglet-store"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert "{{" not in json.dumps(job)  # every placeholder resolved
    two = apply_values(template["job_configuration"], {**_defaults(template), "gpus": 2, "image": "i",
                                                       "store_claim": "c", "name": "run"})
    assert two["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == 2


@pytest.mark.parametrize("name", ["process-gpu.json", "kubernetes-gpu.json"])
def test_every_variable_is_used(name):
    props = _template(name)["variables"]["properties"]
    used = json.dumps(_template(name)["job_configuration"])
    for var in props:
        assert "{{ " + var + " }}" in used, f"{name}: variable {var} is never used"
