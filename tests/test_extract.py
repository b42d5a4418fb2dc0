"""The layer convention: what extraction writes is what vLLM's EAGLE-3 runner feeds the draft."""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from eaglet.data import write_conversations
from eaglet.capture.hf import extract_hidden_states
from eaglet.capture.hf_forward import extract_batch
from eaglet.store import file_sha256


def test_last_state_normed_and_projected_reproduces_logits(tiny_verifier):
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32).eval()
    ids = [[2, 10, 20, 30, 40, 3], [2, 11, 12]]
    states = extract_batch(model, ids, aux_ids=[2, 4, 5], pad_id=1)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids[0]]), output_hidden_states=True)
    s = states[0]
    assert s.shape == (6, 4, 128)
    # aux id k is HF hidden_states[k] (0 = embeddings), in ascending order
    for j, k in enumerate([2, 4, 5]):
        torch.testing.assert_close(s[:, j], ref.hidden_states[k][0], rtol=1e-4, atol=1e-4)
    # the last slot is pre-norm: the verifier's final norm and lm_head turn it into the verifier's logits
    logits = model.lm_head(model.model.norm(s[:, -1]))
    torch.testing.assert_close(logits, ref.logits[0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(s[:, -1], ref.hidden_states[-1][0])  # HF's last entry is post-norm
    # padding does not leak into the shorter sequence
    with torch.no_grad():
        short = model(input_ids=torch.tensor([ids[1]]), output_hidden_states=True)
    torch.testing.assert_close(states[1][:, 0], short.hidden_states[2][0], rtol=1e-4, atol=1e-4)


def test_extraction_writes_speculators_format(tiny_verifier, tmp_path):
    convs = tmp_path / "c.jsonl"
    write_conversations(convs, [[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}],
                                [{"role": "user", "content": "why is the sky blue?"},
                                 {"role": "assistant", "content": "light"}]])
    out = tmp_path / "hs"
    out.mkdir()
    stats = extract_hidden_states(str(tiny_verifier), convs, out, [2, 4, 5], 64, batch_size=2)
    assert stats["samples"] == 2 and stats["bytes_per_token"] == 4 * 128 * 2
    from datasets import load_from_disk

    ds = load_from_disk(str(out))
    assert set(ds.column_names) >= {"input_ids", "loss_mask", "seq_len"}
    for i in range(2):
        f = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert f["hidden_states"].dtype == torch.bfloat16
        assert f["hidden_states"].shape == (ds[i]["seq_len"], 4, 128)
        assert torch.equal(f["token_ids"], ds[i]["input_ids"])
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    assert sum(freq.values()) == sum(int(ds[i]["loss_mask"].sum()) for i in range(2))
    # the digests taken as each file was written, which the artifact's manifest reuses, are the files' own
    written = {str(f.relative_to(out)): file_sha256(f) for f in (out / "hidden_states").glob("hs_*")}
    assert stats["file_sha256"] == written and len(written) == 2


def test_fp8_storage_halves_the_bytes_and_speculators_reads_it_back(tiny_verifier, tmp_path):
    from hs_connectors.transfer import FP8Transfer

    convs = tmp_path / "c.jsonl"
    write_conversations(convs, [[{"role": "user", "content": "why is the sky blue?"},
                                 {"role": "assistant", "content": "light is scattered by the air"}]])
    stores = {}
    for dtype in ("bfloat16", "fp8"):
        out = tmp_path / dtype
        out.mkdir()
        stats = extract_hidden_states(str(tiny_verifier), convs, out, [2, 4, 5], 64, batch_size=1, dtype=dtype)
        stores[dtype] = (out, stats)
    assert stores["fp8"][1]["bytes_per_token"] == 4 * 128 + 4 and stores["bfloat16"][1]["bytes_per_token"] == 1024
    raw = load_file(str(stores["fp8"][0] / "hidden_states" / "hs_0.safetensors"))
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn and raw["hidden_states_scales"].shape[1:] == (1, 1)
    # what speculators' trainer gets through `--hidden-states-backend fp8`
    restored = FP8Transfer(stores["fp8"][0] / "hidden_states").get_cached(0)["hidden_states"].float()
    exact = load_file(str(stores["bfloat16"][0] / "hidden_states" / "hs_0.safetensors"))["hidden_states"].float()
    rel = ((restored - exact).norm() / exact.norm()).item()
    assert restored.shape == exact.shape and 0 < rel < 0.06, rel  # e4m3 keeps ~3 significant bits


def test_interrupted_extraction_resumes_and_redoes_a_corrupted_shard(tiny_verifier, tmp_path):
    """Shards finished before a crash are kept, a damaged one is redone, and the result is byte-identical to an
    uninterrupted extraction."""
    import json

    convs = tmp_path / "c.jsonl"
    write_conversations(convs, [[{"role": "user", "content": f"question {i} about rain"},
                                 {"role": "assistant", "content": "answer " * (i + 1)}] for i in range(8)])

    class Crash(Exception):
        pass

    def crash_after_three(done, total, tps):
        if done == 3:
            raise Crash  # as if killed after the third shard's record was written

    work = tmp_path / "work"
    work.mkdir()
    try:
        extract_hidden_states(str(tiny_verifier), convs, work, [2, 4, 5], 64, batch_size=2,
                              progress=crash_after_three)
    except Crash:
        pass
    records = sorted((work / "hidden_states" / ".shards").glob("*.json"))
    assert [r.name for r in records] == ["0.json", "1.json", "2.json"]
    damaged = next(iter(json.loads(records[1].read_text())["files"]))
    (work / "hidden_states" / damaged).write_bytes(b"not what was recorded")
    stats = extract_hidden_states(str(tiny_verifier), convs, work, [2, 4, 5], 64, batch_size=2)
    assert stats["shards"] == 4 and stats["resumed_shards"] == 2  # shard 1 redone, shard 3 never done

    clean = tmp_path / "clean"
    clean.mkdir()
    extract_hidden_states(str(tiny_verifier), convs, clean, [2, 4, 5], 64, batch_size=2)
    files = sorted(p.relative_to(clean) for p in clean.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(work) for p in work.rglob("*") if p.is_file())
    for f in files:
        assert (clean / f).read_bytes() == (work / f).read_bytes(), f
