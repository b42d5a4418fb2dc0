"""Conversations as a verifier serves them, without an engine: tool calls and results read from the OpenAI and
ShareGPT shapes and validated, rendered through the template with `tools=` and data.chat_template_kwargs, the
turns of data.regenerate_turns=all planned and keyed, reasoning told apart by its tags. The engine side is in
tests/test_conversations_e2e.py."""

from __future__ import annotations

import json

import pytest

from eaglet.capture.rows import loss_mask
from eaglet.capture.vllm import capture_settings, plan_rows
from eaglet.config import load_config
from eaglet.data import (TOOLS, chat_ids, check_rendering, normalize_row, read_conversations, reasoning_end,
                         reasoning_flags, reasoning_tag_ids, row_digest, write_conversations)
from eaglet.errors import EagletError
from eaglet.verifier.tiny import make_tiny_verifier
from tests.conftest import PROMPTS
from tests.conversations import WEATHER, agent_rows, write_rows
from deployments.cli import main


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """The tiny thinking-and-tools verifier's tokenizer and model (a few seconds to make)."""
    from transformers import AutoTokenizer

    texts = [json.dumps(r) for r in agent_rows(40)]
    path = make_tiny_verifier(tmp_path_factory.mktemp("thinking") / "v", PROMPTS, thinking=True, texts=texts)
    return path, AutoTokenizer.from_pretrained(path)


def test_both_shapes_read_as_the_same_openai_messages():
    rows = agent_rows(3)
    openai, sharegpt = normalize_row(rows[0], 1), normalize_row(rows[2], 3)
    assert openai[0] == {"role": TOOLS, "tools": [WEATHER]} and sharegpt[0] == openai[0]
    assert [m["role"] for m in openai[1:]] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert [m["role"] for m in sharegpt[1:]] == [m["role"] for m in openai[1:]]
    call = sharegpt[2]["tool_calls"][0]["function"]
    assert call == {"name": "get_weather", "arguments": {"city": "lima"}}  # JSON text -> an object, as templates want
    assert openai[2]["tool_calls"][0]["function"]["arguments"] == {"city": "paris"}


def test_a_row_without_tools_keeps_its_digest():
    """Rows of the earlier shapes normalise as before: their digests (and the demo's keys) do not move."""
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    assert normalize_row(row, 1) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert row_digest(normalize_row(row, 1)) == row_digest([{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "hello"}])


def test_written_rows_read_back_the_same(tmp_path):
    rows = [normalize_row(r, i) for i, r in enumerate(agent_rows(6), 1)]
    write_conversations(tmp_path / "c.jsonl", rows)
    assert read_conversations(tmp_path / "c.jsonl") == rows


def _bad(edit) -> dict:
    row = agent_rows(1)[0]
    edit(row["messages"], row)
    return row


@pytest.mark.parametrize("edit, words", [
    (lambda m, r: m.pop(1), "line 1 turn 2 is a tool result with no tool call before it to answer"),
    (lambda m, r: m[1]["tool_calls"][0]["function"].update(name="get_time"),
     "line 1 turn 2 calls tool 'get_time', which is unknown (the row's tools are ['get_weather'])"),
    (lambda m, r: r.pop("tools"), "line 1 turn 2 calls tool 'get_weather', which is unknown (the row lists no"),
    (lambda m, r: m[1]["tool_calls"][0]["function"].update(arguments="{city: paris"),
     "line 1 turn 2: the arguments of tool call 'get_weather' is not valid JSON"),
    (lambda m, r: m[1]["tool_calls"][0]["function"].update(arguments="[1, 2]"),
     "the arguments of tool call 'get_weather' are not a JSON object"),
    (lambda m, r: m[2].update(tool_call_id="nope"), "line 1 turn 3 answers tool call id 'nope', which no open call"),
    (lambda m, r: m.insert(3, dict(m[2])), "line 1 turn 4 is a tool result with no tool call before it"),
    (lambda m, r: m[2].update(role="robot"), "unknown role 'robot' (use user/assistant/system/tool)"),
])
def test_malformed_tool_turns_are_one_sentence(tmp_path, edit, words):
    f = write_rows(tmp_path / "bad.jsonl", [_bad(edit)])
    with pytest.raises(EagletError) as e:
        read_conversations(f)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_rendering_passes_tools_and_template_settings(thinking):
    _, tok = thinking
    msgs = normalize_row(agent_rows(1)[0], 1)
    text = tok.convert_ids_to_tokens(chat_ids(tok, msgs, False))
    assert text[:4] == ["<|im_start|>", "system", "<tools>", "get"]  # the tools list, in the system turn
    assert "<tool_call>" in text and "<tool_response>" in text
    on = chat_ids(tok, msgs[:2], True)
    off = chat_ids(tok, msgs[:2], True, {"enable_thinking": False})
    assert tok.convert_ids_to_tokens(on)[-1] == "<think>" and tok.convert_ids_to_tokens(off)[-2:] == ["<think>", "</think>"]


def test_template_problems_are_one_sentence_before_any_load(thinking, tiny_verifier):
    from transformers import AutoTokenizer

    _, tok = thinking
    rows = [normalize_row(r, i) for i, r in enumerate(agent_rows(2), 1)]
    check_rendering(tok, rows, {"enable_thinking": True}, "d.jsonl")  # fine
    with pytest.raises(EagletError, match=r"sets 'thinking', which the verifier's chat template never reads \(it "
                                          r"reads \['enable_thinking'\]\)"):
        check_rendering(tok, rows, {"thinking": True}, "d.jsonl")
    plain = AutoTokenizer.from_pretrained(tiny_verifier)  # its template knows no tools
    with pytest.raises(EagletError, match="d.jsonl row 1 lists tools, but the verifier's chat template does not render"):
        check_rendering(plain, rows, {}, "d.jsonl")


@pytest.mark.parametrize("sets, words", [
    (["data.chat_template_kwargs={\"thinking\": true}"], "sets 'thinking', which the verifier's chat template never"),
    (["data.reasoning_in_loss=false", "data.reasoning_tags=[\"<r>\", \"</r>\"]"], "to be one token each"),
    (["data.regenerate_turns=all", "data.responses_per_prompt=2", "data.temperature=0.7"], "answers each turn once"),
])
def test_eaglet_run_refuses_bad_conversation_settings(thinking, tmp_path, capsys, sets, words):
    path, _ = thinking
    data = write_rows(tmp_path / "d.jsonl", agent_rows(8))
    args = [f"--set={s}" for s in [f"verifier.path={path}", f"data.path={data}", *sets]]
    rc = main(["run", *args, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("eaglet: error:") and words in err[0], err
    assert not (tmp_path / "out").exists()


def test_eaglet_run_refuses_a_malformed_tool_turn_and_a_template_without_tools(tiny_verifier, tmp_path, capsys):
    data = write_rows(tmp_path / "d.jsonl", [_bad(lambda m, r: m.pop(1))])
    for data_file, verifier, words in ((data, tiny_verifier, "is a tool result with no tool call"),
                                       (write_rows(tmp_path / "ok.jsonl", agent_rows(8)), tiny_verifier,
                                        "lists tools, but the verifier's chat template does not render tools")):
        rc = main(["run", f"--set=verifier.path={verifier}", f"--set=data.path={data_file}",
                   "--output-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("eaglet: error:") and words in err[0], err


def test_all_turns_are_planned_each_keyed_after_the_one_before(thinking, tmp_path):
    path, _ = thinking
    settings = capture_settings([2, 4, 5, 8], 256, "bfloat16", True, 16, 0.0, 1, 0, "float32", "all")
    full = write_rows(tmp_path / "full.jsonl", agent_rows(6))
    planned, skipped = plan_rows(str(path), full, "f" * 16, settings)
    assert skipped == 0 and len(planned) == 18  # three answered turns a conversation
    turns = [reqs[0].get("turn", 0) for reqs in planned.values()]
    assert turns == [0, 1, 2] * 6
    later = [reqs[0] for reqs in planned.values() if reqs[0].get("turn")]
    assert all("prompt_ids" not in r and len(r["answer_keys"]) == r["turn"] for r in later)
    # the same conversations one turn shorter: the same keys for the turns they share
    short, _ = plan_rows(str(path), write_rows(tmp_path / "short.jsonl", agent_rows(6, turns=2)), "f" * 16, settings)
    assert set(short) < set(planned) and len(set(planned) - set(short)) == 6
    # the last-turn plan of today: one row per conversation, its prompt everything before the last answer
    last, _ = plan_rows(str(path), full, "f" * 16, capture_settings([2, 4, 5, 8], 256, "bfloat16", True, 16, 0.0, 1,
                                                                   0, "float32"))
    assert len(last) == 6 and set(last).isdisjoint(planned)


def test_reasoning_flags_and_masks():
    tags = (7, 8)
    # the prompt opened the block (a generation prompt ending in <think>): the answer starts inside it
    ids = [1, 2, 7, 3, 4, 8, 5, 6]
    assert reasoning_flags(ids, 3, tags) == [True, True, True, False, False]
    assert reasoning_end(ids[3:], ids[:3], tags) == 3
    # the answer opens its own block; none at all; no tags in the vocabulary
    assert reasoning_flags([1, 7, 3, 8, 5], 1, tags) == [True, True, True, False]
    assert reasoning_end([5, 6], [1], tags) == 0 and reasoning_flags([1, 7, 3], 1, None) == [False, False]
    mask = [0, 0, 0, 1, 1, 1, 1, 1]
    assert loss_mask(ids, mask, tags) == [0, 0, 0, 0, 0, 0, 1, 1] and loss_mask(ids, mask, None) == mask


def test_thinking_verifier_tags_are_single_tokens(thinking, tiny_verifier):
    from transformers import AutoTokenizer

    _, tok = thinking
    assert reasoning_tag_ids(tok, ("<think>", "</think>")) is not None
    assert reasoning_tag_ids(AutoTokenizer.from_pretrained(tiny_verifier), ("<think>", "</think>")) is None


def test_config_lists_the_new_settings():
    cfg = load_config(None, ["data.regenerate_turns=all", "data.chat_template_kwargs={\"enable_thinking\": true}"])
    assert cfg.data.regenerate_turns == "all" and cfg.data.chat_template_kwargs == {"enable_thinking": True}


def test_smoke_phases_split_reasoning_from_the_final_answer_and_join_again():
    from eaglet.evaluate.smoke import join_phases, smoke_result, split_phases

    tags, prompts = (7, 8), [[1, 7], [1, 2], [1, 7]]  # prompts 0 and 2 open a reasoning block; prompt 1 does not
    baseline_ids = [[3, 8, 5, 6], [4, 5, 6, 9], [8, 6, 6, 6]]
    phases, ends = split_phases(prompts, baseline_ids, 4, tags)
    assert ends == [2, 0, 1]
    assert phases[0] == [{"prompt_ids": [1, 7], "max_tokens": 2}, {"prompt_ids": [1, 7], "max_tokens": 1}]
    assert phases[1] == [{"prompt_ids": [1, 7, 3, 8], "max_tokens": 2}, {"prompt_ids": [1, 2], "max_tokens": 4},
                         {"prompt_ids": [1, 7, 8], "max_tokens": 3}]
    spec = {"drafts": 2, "draft_tokens": 6, "accepted": 2, "accepted_per_pos": [2, 0, 0]}
    none = {"drafts": 4, "draft_tokens": 12, "accepted": 0, "accepted_per_pos": [0, 0, 0]}
    result = {"phases": [{"token_ids": [[[3, 8]], [[8]]], "spec": spec},
                         {"token_ids": [[[5, 6]], [[4, 5, 6, 9]], [[6, 6, 6]]], "spec": none}],
              "spec": {"drafts": 6, "draft_tokens": 18, "accepted": 2, "accepted_per_pos": [2, 0, 0]},
              "tokens_per_s": 1.0, "load_seconds": 0.0}
    joined = join_phases(result, ends, 4)
    assert joined["token_ids"] == [[b] for b in baseline_ids]
    baseline = {"token_ids": [[b] for b in baseline_ids], "tokens_per_s": 1.0, "load_seconds": 0.0,
                "measured_at": "now", "host": "here"}
    r = smoke_result(joined, baseline, "eagle3", 3)
    assert r.lossless and r.reasoning_share == 3 / 12 and r.acceptance_reasoning == 2.0 and r.acceptance_answer == 1.0
    # no answer opens a block: one phase, as before, and no split in the result
    phases, ends = split_phases(prompts[1:2], baseline_ids[1:2], 4, tags)
    assert ends is None and len(phases) == 1 and smoke_result(
        {"token_ids": [[baseline_ids[1]]], "spec": none, "tokens_per_s": 1.0, "load_seconds": 0.0},
        {**baseline, "token_ids": [[baseline_ids[1]]]}, "eagle3", 3).reasoning_share is None
