"""Prefect's side of the keys (eaglet.keys): a task's cache key is its artifact's store key, and a task whose
artifact is gone runs again with Prefect's own refresh_cache instead of handing on a dead path."""

from __future__ import annotations

import inspect

from eaglet import store


def cache_key(kind: str, key_fn, artifact: bool = True):
    """A task's Prefect cache key: its artifact's store key. `artifact_missing` (read by `refreshed`) says when that
    artifact is gone or damaged (gc, by hand), so the cached result would hand later tasks a dead path."""
    def key(_ctx, params) -> str:
        return f"eaglet-{kind}-{key_fn(**params)}"

    def artifact_missing(params) -> bool:
        path = store.artifact_path(kind, key_fn(**params))
        return artifact and not (store.is_published(path) and store.intact(path))

    key.artifact_missing = artifact_missing
    return key


def refreshed(task, *args):
    """The task to call with these arguments: as defined, or, when its artifact is gone, with Prefect's
    refresh_cache, so it runs, rebuilds the artifact under the same store key and overwrites its cache record."""
    missing = getattr(task.cache_key_fn, "artifact_missing", None)
    if missing and missing(inspect.signature(task.fn).bind(*args).arguments):
        return task.with_options(refresh_cache=True)
    return task
