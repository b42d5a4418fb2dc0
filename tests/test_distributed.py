"""Sharded extraction on a local Dask cluster: two workers, each loading the verifier once, write the same
artifact as one worker."""

from __future__ import annotations


import pytest

from eaglet.capture.hf import extract_hidden_states
from eaglet.store import file_sha256
from tests.conversations import write_echo_conversations


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return write_echo_conversations(tmp_path_factory.mktemp("dist") / "c.jsonl", 40)


def content(path) -> dict[str, str]:
    """Every file under path (hidden states, dataset, token counts) by relative name -> sha256."""
    return {str(f.relative_to(path)): file_sha256(f) for f in sorted(path.rglob("*")) if f.is_file()}


def _extract(tiny_verifier, conversations, out, **kw) -> dict:
    out.mkdir()
    return extract_hidden_states(str(tiny_verifier), conversations, out, [2, 4, 5], 128, batch_size=4, **kw)


def test_two_dask_workers_write_the_same_artifact_as_one(tiny_verifier, conversations, tmp_path):
    from dask.distributed import LocalCluster

    # The 1-worker reference goes through Dask too, so both sides compute in worker processes alike.
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as one:
        single = _extract(tiny_verifier, conversations, tmp_path / "one", scheduler=one.scheduler_address)
    double = _extract(tiny_verifier, conversations, tmp_path / "two", workers=2)
    assert single["shards"] == double["shards"] == 10 and single["extracted_tokens"] == double["extracted_tokens"]
    assert list(single["worker_verifier_loads"].values()) == [1]
    assert sorted(double["worker_verifier_loads"].values()) == [1, 1]  # each worker loaded it once, both worked
    files = content(tmp_path / "one")
    assert len([f for f in files if f.startswith("hidden_states/hs_")]) == 40
    assert files == content(tmp_path / "two")


def test_in_process_extraction_matches_the_cluster(tiny_verifier, conversations, tmp_path):
    local = _extract(tiny_verifier, conversations, tmp_path / "local")
    cluster = _extract(tiny_verifier, conversations, tmp_path / "cluster", workers=2)
    assert "worker_verifier_loads" not in local
    assert content(tmp_path / "local") == content(tmp_path / "cluster")
