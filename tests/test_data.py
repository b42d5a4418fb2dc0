"""Data preparation: every supported row shape, loss masks on assistant tokens only, and clear errors."""

import json

import pytest
from transformers import AutoTokenizer

from eaglet.data import (assistant_mask, check_has_responses, normalize_row, prompt_digest, read_conversations,
                         row_digest, split_conversations, tokenize_conversations)
from eaglet.errors import EagletError

SHAPES = {
    "sharegpt_from_value": {"conversations": [{"from": "human", "value": "hello there"},
                                              {"from": "gpt", "value": "hi friend"}]},
    "sharegpt_role_content": {"conversations": [{"role": "user", "content": "hello there"},
                                                {"role": "assistant", "content": "hi friend"}]},
    "openai_messages": {"messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "hello there"},
                                     {"role": "assistant", "content": "hi friend"}]},
    "prompt_response": {"prompt": "hello there", "response": "hi friend"},
}


@pytest.fixture(scope="module")
def tok(tiny_verifier):
    return AutoTokenizer.from_pretrained(tiny_verifier)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_loss_mask_covers_exactly_the_assistant_turn(tok, shape):
    msgs = normalize_row(SHAPES[shape], 1)
    ids, mask = assistant_mask(tok, msgs, 512)
    masked = [t for t, m in zip(ids, mask) if m]
    answer = tok("hi friend", add_special_tokens=False)["input_ids"]
    # the answer, then the template's end-of-turn token: that is what the draft must learn to predict
    assert masked[: len(answer)] == answer
    assert tok.decode(masked[len(answer):]).strip() == "<|im_end|>"
    assert len(ids) == len(mask) and sum(mask) == len(answer) + 1


def test_multi_turn_masks_every_assistant_turn(tok):
    msgs = normalize_row({"messages": [
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"}, {"role": "assistant", "content": "four five"}]}, 1)
    ids, mask = assistant_mask(tok, msgs, 512)
    assert tok.decode([t for t, m in zip(ids, mask) if m]).split() == ["two", "<|im_end|>", "four", "five", "<|im_end|>"]


def test_prompt_only_row_has_no_loss_and_truncation(tok):
    samples, freq = tokenize_conversations(tok, [normalize_row(SHAPES["prompt_response"], 1)], max_seq_len=9)
    assert samples[0]["seq_len"] == 9 and len(samples[0]["loss_mask"]) == 9
    assert sum(freq.values()) == sum(samples[0]["loss_mask"])
    with pytest.raises(EagletError, match="max_seq_len"):
        tokenize_conversations(tok, [normalize_row(SHAPES["prompt_response"], 1)], max_seq_len=4)


def write(tmp_path, rows):
    p = tmp_path / "d.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


@pytest.mark.parametrize("rows, message", [
    ([], "is empty"),
    (['{"prompt": "x"'], "not valid JSON"),
    ([{"text": "hello"}], "unknown row shape"),
    ([{"messages": [{"role": "wizard", "content": "x"}]}], "unknown role"),
    ([{"messages": [{"role": "assistant", "content": "x"}]}], "no user turn"),
])
def test_bad_rows_are_named(tmp_path, rows, message):
    with pytest.raises(EagletError, match=message):
        read_conversations(write(tmp_path, rows))


def test_missing_dataset(tmp_path):
    with pytest.raises(EagletError, match="does not exist"):
        read_conversations(tmp_path / "nope.jsonl")


def test_rows_without_assistant_turn_need_regeneration(tmp_path):
    rows = read_conversations(write(tmp_path, [{"prompt": "a"}, {"prompt": "b", "response": "c"}]))
    with pytest.raises(EagletError, match="1 training rows have no assistant turn"):
        check_has_responses(rows)


def test_split_depends_on_each_row_alone(tmp_path):
    """Held out or not by the row's prompt digest and the seed: appending, removing or reordering other rows never
    moves a row between train and eval; duplicates collapse; the order is the digests', not the file's."""
    rows = [[{"role": "user", "content": str(i)}] for i in range(400)]
    train, held, counts = split_conversations(rows, 0.1, seed=3)
    assert (train, held) == split_conversations(list(reversed(rows)), 0.1, seed=3)[:2]
    assert 20 <= len(held) <= 60 and len(train) + len(held) == 400 and counts["duplicates"] == 0
    assert not {r[0]["content"] for r in train} & {r[0]["content"] for r in held}
    grown = rows + [[{"role": "user", "content": f"new {i}"}] for i in range(40)] + rows[:5]  # 5 duplicates
    train2, held2, counts2 = split_conversations(grown, 0.1, seed=3)
    assert counts2["duplicates"] == 5
    assert {r[0]["content"] for r in held} <= {r[0]["content"] for r in held2}  # old held-out rows stay held out
    assert {r[0]["content"] for r in train} <= {r[0]["content"] for r in train2}
    assert split_conversations(rows, 0.1, seed=4)[1] != held  # the seed draws another split
    with pytest.raises(EagletError, match="eval_fraction"):
        split_conversations(rows[:3], 0.01, seed=0)


def test_fixed_eval_file_is_never_trained_on():
    rows = [[{"role": "user", "content": str(i)}, {"role": "assistant", "content": "a"}] for i in range(20)]
    fixed = [[{"role": "user", "content": "3"}], [{"role": "user", "content": "7"}]]
    train, held, counts = split_conversations(rows, 0.5, seed=0, eval_rows=fixed)
    assert held == sorted(fixed, key=row_digest) and counts["eval_overlap"] == 2 and len(train) == 18
    assert not {"3", "7"} & {r[0]["content"] for r in train}


def test_shipped_eval_rows_are_shipped_prompts():
    from eaglet.data import DEFAULT_EVAL, DEFAULT_PROMPTS

    prompts = {json.loads(line)["prompt"] for line in DEFAULT_PROMPTS.read_text().splitlines()}
    held = [json.loads(line)["prompt"] for line in DEFAULT_EVAL.read_text().splitlines()]
    assert len(held) == len(set(held)) == 40 and set(held) <= prompts


def test_files_grown_from_the_shipped_prompts_keep_the_shipped_held_out_rows(tmp_path):
    """The nightly leak: the shipped prompts plus new rows as a new file, no data.eval_path. A digest split would
    move shipped held-out prompts into training and hold out prompts the cold draft trained on; the file keeps the
    shipped held-out rows instead. data.eval_path still wins, and an unrelated file is split by digest."""
    from eaglet.data import DEFAULT_EVAL, DEFAULT_PROMPTS, held_out_file, prompt_digests

    grown = tmp_path / "grown.jsonl"
    grown.write_text(DEFAULT_PROMPTS.read_text() + json.dumps({"prompt": "a new prompt"}) + "\n")
    rows = read_conversations(grown)
    assert held_out_file(rows, None, str(grown)) == str(DEFAULT_EVAL)
    assert held_out_file(read_conversations(DEFAULT_PROMPTS), None, None) == str(DEFAULT_EVAL)
    assert held_out_file(rows, str(tmp_path / "mine.jsonl"), str(grown)) == str(tmp_path / "mine.jsonl")
    own = [[{"role": "user", "content": f"own {i}"}] for i in range(50)]
    assert held_out_file(own, None, "own.jsonl") is None
    one_shipped = own + read_conversations(DEFAULT_EVAL)[:1]  # one shipped held-out prompt is enough
    assert held_out_file(one_shipped, None, "own.jsonl") == str(DEFAULT_EVAL)
    train, held, _ = split_conversations(rows, 0.04, 0, eval_rows=read_conversations(DEFAULT_EVAL))
    assert {row_digest(m) for m in held} == {row_digest(m) for m in read_conversations(DEFAULT_EVAL)}
    assert not prompt_digests(DEFAULT_EVAL) & {prompt_digest(m) for m in train}


def test_default_prompts_file_is_large_and_varied():
    from eaglet.data import DEFAULT_PROMPTS

    rows = [json.loads(line) for line in DEFAULT_PROMPTS.read_text().splitlines()]
    assert len(rows) >= 300
    assert {r["category"] for r in rows} == {"chat", "explanation", "code", "math", "writing"}
    assert len({r["prompt"] for r in rows}) == len(rows)
