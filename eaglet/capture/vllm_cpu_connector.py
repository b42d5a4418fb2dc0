"""vLLM's ExampleHiddenStatesConnector for vLLM's CPU backend: the same files, without the CUDA copy path.

Upstream (vllm 0.32, `ExampleHiddenStatesConnector._submit_async_write`) copies each finished request's hidden
states out of the cache through pinned host memory on a CUDA stream and polls CUDA events; on CPU that stops at
"pin_memory=True requires a CUDA or other accelerator backend". On CPU the cache already is host memory, so this
subclass copies synchronously. Which tokens, which layers, the slot arithmetic and the file layout are
upstream's. Loaded by vLLM's workers through `kv_connector_module_path` (they are separate processes).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event upstream polls in get_finished: the copy is finished when it is made."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        hidden_states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # taken with LOCK_EX in wait_for_save
        try:
            save_file({"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # readers waiting in load_hidden_states go on
        self._req_copy_events[pending.req_id] = _Done()
