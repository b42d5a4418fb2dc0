"""The draft's attention in speculators' training, computed where its mask allows and nowhere else (CPU only).

speculators 0.9 packs several conversations into one row of `--total-seq-len` tokens and, with `--draft-attn-impl
sdpa`, hands attention a dense boolean mask: causal within each conversation in the first block of keys, plus
one diagonal block per earlier TTT step (position i also sees its own draft state). Torch's CPU SDPA kernel
computes every query against every key and masks afterwards, so at the third TTT step a 1,024-token row costs
1,024 x 3,072 scores where a few per cent are allowed; attention was a fifth of a training step on 2 cores
(torch profiler, 30 steps of the demo's training).

`chunked_sdpa` splits the queries into chunks of CHUNK rows and gives each chunk only the keys its mask rows
can reach (from the earliest allowed key to the chunk's end, and the same rows of each later block), with the
mask sliced to match. It reads the real mask: nothing about conversations or TTT is assumed, and a chunk whose
allowed keys fall outside those columns (any other mask) is computed by the plain kernel over every key."""

from __future__ import annotations

import contextlib

import torch

CHUNK = 128


def _chunk_columns(mask: torch.Tensor, start: int, stop: int, q_len: int) -> list[slice] | None:
    """The key ranges the mask rows start:stop may use: [earliest allowed key, stop) of the first block and the
    same rows' columns of every later block. None if a True entry lies elsewhere."""
    rows = mask[start:stop]
    first = rows[:, :q_len].any(dim=0).nonzero()
    lo = int(first[0]) if len(first) else start
    cols = [slice(min(lo, start), stop)] + [slice(b + start, b + stop) for b in range(q_len, rows.shape[1], q_len)]
    inside = sum(int(rows[:, c].sum()) for c in cols)
    return cols if inside == int(rows.sum()) else None


def chunked_sdpa(sdpa):
    """Wrap transformers' sdpa attention function (same signature and result) for speculators' packed TTT rows."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        q_len, kv_len = query.shape[2], key.shape[2]
        if (attention_mask is None or attention_mask.dtype != torch.bool or query.shape[0] != 1
                or attention_mask.shape[:2] != (1, 1) or kv_len % q_len or q_len <= CHUNK):
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        mask = attention_mask[0, 0]
        chunks = [(start, min(start + CHUNK, q_len)) for start in range(0, q_len, CHUNK)]
        columns = [_chunk_columns(mask, start, stop, q_len) for start, stop in chunks]
        if any(cols is None for cols in columns):  # decided before any chunk is computed
            return sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        outputs = []
        for (start, stop), cols in zip(chunks, columns):
            k = torch.cat([key[:, :, c] for c in cols], dim=2)
            v = torch.cat([value[:, :, c] for c in cols], dim=2)
            m = torch.cat([attention_mask[:, :, start:stop, c] for c in cols], dim=3)
            out, _ = sdpa(module, query[:, :, start:stop], k, v, m, *args, **kwargs)
            outputs.append(out)  # [1, rows, heads, head_dim]
        return torch.cat(outputs, dim=1), None

    return attention


@contextlib.contextmanager
def chunked_ttt_attention():
    """transformers' "sdpa" attention is chunked_sdpa while this is open (speculators' draft layer looks it up
    on every call)."""
    from transformers.modeling_utils import AttentionInterface

    saved = AttentionInterface._global_mapping["sdpa"]
    AttentionInterface._global_mapping["sdpa"] = chunked_sdpa(saved)
    try:
        yield
    finally:
        AttentionInterface._global_mapping["sdpa"] = saved
