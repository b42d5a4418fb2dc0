"""`eaglet cache ls|gc`: what is in the store, and deleting old artifacts without touching ones in use."""

import json
import os
import time

from eaglet import store
from tests.conftest import run_cli


def _artifacts(root):
    paths = {}
    for kind, key, age in (("hidden_states", "old1", 3 * 86400), ("hidden_states", "old2", 2 * 86400),
                           ("hidden_states", "new", 60), ("vocab", "oldv", 5 * 86400)):
        p = store.publish(kind, key, lambda d: (d / "x.bin").write_bytes(b"0" * 2048), root=root)
        (p / store.LAST_USED).write_text(str(time.time() - age))
        paths[key] = p
    return paths


def test_ls_lists_kind_size_age_fingerprint_and_last_use(tmp_path):
    _artifacts(tmp_path)
    proc = run_cli(["cache", "ls", "--json"], {"EAGLET_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    rows = {r["key"]: r for r in json.loads(proc.stdout)}
    assert set(rows) == {"old1", "old2", "new", "oldv"} and rows["new"]["kind"] == "hidden_states"
    assert rows["old1"]["bytes"] == 2048 and time.time() - rows["old1"]["last_used"] > 2.9 * 86400
    text = run_cli(["cache", "ls"], {"EAGLET_HOME": str(tmp_path)}).stdout
    assert "old1" in text and "4 artifacts" in text and "3d" in text


def test_gc_by_age_and_keep_last_never_deletes_what_is_in_use(tmp_path):
    paths = _artifacts(tmp_path)
    env = {"EAGLET_HOME": str(tmp_path)}
    dry = run_cli(["cache", "gc", "--older-than", "1d", "--dry-run"], env)
    assert dry.returncode == 0 and dry.stdout.count("would delete hidden_states/") == 2, dry.stdout
    assert all(p.exists() for p in paths.values())

    with store.in_use(paths["old2"]):  # a live run has been reading it for two days (say, a long training)
        (paths["old2"] / store.LAST_USED).write_text(str(time.time() - 2 * 86400))
        proc = run_cli(["cache", "gc", "--older-than", "1d", "--keep-last", "1"], env)
    assert proc.returncode == 0, proc.stderr
    assert "kept hidden_states/old2: in use" in proc.stdout
    assert not paths["old1"].exists() and paths["old2"].exists() and paths["new"].exists()
    assert paths["oldv"].exists()  # the last of its kind is kept
    assert sorted(os.listdir(tmp_path / "hidden_states")) == ["new", "old2"]


def test_gc_needs_a_criterion(tmp_path):
    proc = run_cli(["cache", "gc"], {"EAGLET_HOME": str(tmp_path)})
    assert proc.returncode == 2 and "needs --older-than" in proc.stderr
