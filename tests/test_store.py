"""Artifacts are published whole or not at all."""

import json

import pytest

from eaglet import store


def test_publish_is_atomic_and_idempotent(tmp_path):
    calls = []

    def build(d):
        calls.append(d)
        (d / "a.txt").write_text("x")

    p = store.publish("kind", "k1", build, root=tmp_path)
    assert (p / "a.txt").read_text() == "x" and store.is_published(p)
    assert store.publish("kind", "k1", build, root=tmp_path) == p and len(calls) == 1


def test_the_builders_digests_are_taken_not_recomputed(tmp_path):
    def build(d):
        (d / "states.bin").write_bytes(b"hidden states")
        (d / "stats.json").write_text("{}")
        return {"states.bin": "0" * 64}  # what the builder says it hashed as it wrote (deliberately wrong here)

    p = store.publish("kind", "k3", build, root=tmp_path)
    files = json.loads((p / store.MANIFEST).read_text())["files"]
    assert files["states.bin"]["sha256"] == "0" * 64  # taken as given: the file was not read again
    assert files["stats.json"]["sha256"] == store.file_sha256(p / "stats.json")  # not given: hashed here
    assert store.verify(p) == ["states.bin"]  # and `verify` (cache verify, damaged-artifact checks) still reads


def test_failed_build_leaves_nothing(tmp_path):
    def build(d):
        (d / "half.bin").write_text("partial")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        store.publish("kind", "k2", build, root=tmp_path)
    assert list((tmp_path / "kind").iterdir()) == []


def test_publish_dir_replaces_whole(tmp_path):
    store.publish_dir(lambda d: (d / "v1").write_text("1"), tmp_path / "draft")
    store.publish_dir(lambda d: (d / "v2").write_text("2"), tmp_path / "draft")
    assert sorted(p.name for p in (tmp_path / "draft").iterdir()) == ["v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


# --- one builder per key, and a dead builder never blocks ----------------------------------------------------

BUILDER = """
import sys, time
from pathlib import Path
from eaglet import store
root, key, seconds, log = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
def build(d):
    with log.open("a") as f:
        f.write("build\\n")
    time.sleep(seconds)
    (d / "out.txt").write_text(key)
print(store.publish("kind", key, build, root=root), flush=True)
"""


def _builder(tmp_path, key, seconds):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path / "root"), key, str(seconds),
                             str(tmp_path / "builds.log")], stdout=subprocess.PIPE, text=True)


def test_two_identical_builds_at_once_build_once(tmp_path):
    a = _builder(tmp_path, "same", 3)
    b = _builder(tmp_path, "same", 3)
    out_a, out_b = a.communicate(timeout=60)[0], b.communicate(timeout=60)[0]
    assert a.returncode == b.returncode == 0
    assert out_a == out_b and (tmp_path / "builds.log").read_text() == "build\n"  # the other waited and reused


def test_lock_of_a_killed_builder_expires(tmp_path):
    import time

    holder = _builder(tmp_path, "k", 3600)
    deadline = time.time() + 30
    while not (tmp_path / "builds.log").is_file() and time.time() < deadline:  # it holds the lock, building
        time.sleep(0.05)
    holder.kill()  # SIGKILL: no cleanup code runs
    holder.wait()
    t0 = time.time()
    p = store.publish("kind", "k", lambda d: (d / "out.txt").write_text("mine"), root=tmp_path / "root")
    assert (p / "out.txt").read_text() == "mine" and time.time() - t0 < 5


def test_a_damaged_artifact_is_detected_and_rebuilt(tmp_path):
    calls = []

    def build(d):
        calls.append(1)
        (d / "weights.bin").write_bytes(b"x" * 1000)

    p = store.publish("kind", "k", build, root=tmp_path)
    assert store.verify(p) == []
    (p / "weights.bin").write_bytes(b"x" * 10)  # truncated behind the store's back
    assert store.verify(p) == ["weights.bin"] and not store.intact(p)
    p2 = store.publish("kind", "k", build, root=tmp_path)
    assert p2 == p and len(calls) == 2 and (p / "weights.bin").stat().st_size == 1000
    assert any(x.name.startswith(".corrupt-k-") for x in (tmp_path / "kind").iterdir())


def test_a_resumable_build_finds_what_the_failed_attempt_left(tmp_path):
    seen = []

    def build(d):
        seen.append(sorted(x.name for x in d.iterdir()))
        if not (d / "shard0").exists():
            (d / "shard0").write_text("done")
            raise RuntimeError("killed")
        (d / "shard1").write_text("done")

    with pytest.raises(RuntimeError):
        store.publish("kind", "r", build, root=tmp_path, resumable=True)
    p = store.publish("kind", "r", build, root=tmp_path, resumable=True)
    assert seen == [[], ["shard0"]] and sorted(json.loads((p / "manifest.json").read_text())["files"]) == [
        "shard0", "shard1"]
