"""Prefect's side of the keys (eaglet.keys): a task's cache key is its artifact's store key, and a task whose
artifact is gone runs again with Prefect's own refresh_cache instead of handing on a dead path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.utilities.callables import get_call_parameters

from eaglet import store


@dataclass(init=False)
class ArtifactKey(CachePolicy):
    """The cache key of a task that builds one store artifact: `eaglet-<kind>-<store key>`. kind: the store kind,
    or a function of the task's inputs that gives it; artifact=False: the result is the task's return value
    alone (nothing in the store to check)."""

    def __init__(self, kind: str | Callable[..., str], key_fn: Callable[..., str], artifact: bool = True) -> None:
        super().__init__()
        self.kind, self.key_fn, self.artifact = kind, key_fn, artifact

    def kind_of(self, inputs: dict[str, Any]) -> str:
        return self.kind if isinstance(self.kind, str) else self.kind(**inputs)

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs) -> str:
        return f"eaglet-{self.kind_of(inputs)}-{self.key_fn(**inputs)}"

    def artifact_missing(self, inputs: dict[str, Any]) -> bool:
        """The artifact is gone or damaged (gc, by hand): a cached result would hand later tasks a dead path."""
        if not self.artifact:
            return False
        return not store.holds(self.kind_of(inputs), self.key_fn(**inputs))


def refreshed(task, *args):
    """The task to call with these arguments: as defined, or, when its artifact is gone, with Prefect's
    refresh_cache, so it runs, rebuilds the artifact under the same store key and overwrites its cache record."""
    policy = task.cache_policy
    if isinstance(policy, ArtifactKey) and policy.artifact_missing(get_call_parameters(task.fn, args, {})):
        return task.with_options(refresh_cache=True)
    return task
