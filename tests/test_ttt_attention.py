"""The chunked attention used by CPU training equals torch's SDPA over every key, output and gradients."""

import pytest
import torch
from speculators.models.eagle3.attention import create_combined_mask_mod, extend_dense_mask_for_draft_tokens
from torch.nn.attention.flex_attention import create_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

from eaglet.train import ttt_attention  # the module, patched by the tests
from eaglet.train.ttt_attention import chunked_sdpa


class _Module(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def _compare(mask, q_len, steps_kv):
    """Returns how many times the chunked version called the kernel (1: it fell back to every key)."""
    torch.manual_seed(0)
    q = torch.randn(1, 6, q_len, 16, requires_grad=True)
    k = torch.randn(1, 2, steps_kv, 16, requires_grad=True)
    v = torch.randn(1, 2, steps_kv, 16, requires_grad=True)
    want, _ = sdpa(_Module(), q, k, v, mask, scaling=0.25)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    calls = []
    got, _ = chunked_sdpa(lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))(_Module(), q, k, v, mask, scaling=0.25)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    return len(calls)


@pytest.mark.parametrize("lengths", [[70, 40, 90, 30], [300], [5] * 40])
def test_every_ttt_step_of_a_packed_row(monkeypatch, lengths):
    """speculators' own masks for a row of packed conversations and padding, steps 0-2 of TTT."""
    monkeypatch.setattr(ttt_attention, "CHUNK", 32)
    q_len = 300
    doc = torch.full((q_len,), -1)
    at = 0
    for i, n in enumerate(lengths):
        doc[at:at + n] = i
        at += n
    mask = create_mask(create_combined_mask_mod(doc, q_len), None, None, q_len, q_len, device="cpu")
    for step in range(3):
        assert _compare(mask, q_len, q_len * (step + 1)) == 10  # ceil(300 / 32) chunks, none over every key
        mask = extend_dense_mask_for_draft_tokens(mask, q_len)


def test_any_other_mask_gets_every_key(monkeypatch):
    """A mask that is not causal within chunks (here: random) is computed over all keys, still equal."""
    monkeypatch.setattr(ttt_attention, "CHUNK", 32)
    torch.manual_seed(1)
    mask = torch.rand(1, 1, 100, 200) < 0.3
    mask[0, 0, :, 0] = True
    assert _compare(mask, 100, 200) == 1
