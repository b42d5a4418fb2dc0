"""Artifacts are published whole or not at all."""

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
