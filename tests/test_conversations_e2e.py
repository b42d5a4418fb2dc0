"""Agent conversations end to end on the tiny thinking-and-tools verifier (eaglet.verifier.tiny.THINKING_TEMPLATE,
after Qwen3's and Kimi-K2.5's templates; every answer opens with a reasoning block): a capture pass answers
the first two turns of each conversation, then `eaglet run` with data.regenerate_turns=all on the same
conversations grown by a third turn computes only the new turns, trains, exports and smoke-tests the draft
(lossless, acceptance on reasoning and on the final answer). The captured ids are checked token for token
against the template applied to the regenerated conversation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from eaglet.capture.engine import start_for_run, stop_for_run
from eaglet.capture.rows import read_row, row_path, view_rows
from eaglet.capture.vllm import capture_for_run
from eaglet.config import load_config
from eaglet.data import TOOLS, chat_ids, reasoning_flags, reasoning_tag_ids
from eaglet.verifier import resolve_verifier
from eaglet.verifier.tiny import REASONING, make_tiny_verifier
from tests.conftest import PROMPTS, TINY_RUN, run_cli
from tests.conversations import WEATHER, agent_rows, write_rows

pytestmark = pytest.mark.e2e

N_TRAIN, N_HELD = 16, 8


@pytest.fixture(scope="module")
def agent(session_dir):
    work = session_dir / "agent"
    work.mkdir()
    full, held = agent_rows(N_TRAIN), agent_rows(N_HELD, offset=200)
    texts = [json.dumps(r) for r in full + held]
    verifier = make_tiny_verifier(work / "thinking-verifier", PROMPTS, thinking=True, texts=texts)
    data, eval_file = write_rows(work / "agent.jsonl", full), write_rows(work / "held.jsonl", held)
    sets = TINY_RUN + [f"verifier.path={verifier}", f"data.path={data}", f"data.eval_path={eval_file}",
                       "data.regenerate_turns=all", f"smoke.num_prompts={N_HELD}"]
    cfg = load_config(None, sets)

    # An earlier pass: the same conversations with two turns each, through the run's own capture settings.
    short = work / "short-data"
    short.mkdir()
    write_rows(short / "train.jsonl", agent_rows(N_TRAIN, turns=2))
    info = resolve_verifier(str(verifier))
    engines = start_for_run(info, cfg, work / "engine")
    try:
        (work / "short-view").mkdir()
        earlier = capture_for_run(engines, info, str(short), work / "short-view", cfg, None, None)
    finally:
        stop_for_run(engines)

    out = work / "run"
    proc = run_cli(["run", *[f"--set={s}" for s in sets], "--output-dir", str(out)])
    (work / "run.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"out": out, "report": json.loads((out / "report.json").read_text()), "earlier": earlier,
            "verifier": verifier, "cfg": cfg}


def test_agent_conversations_train_end_to_end_lossless_with_both_acceptance_figures(agent):
    r = agent["report"]
    x, s = r["extraction"], r["smoke"]
    assert x["turns"] == "all" and x["samples"] == 3 * N_TRAIN  # one sample per answered turn
    assert s["lossless"] and s["num_prompts"] == N_HELD
    assert x["reasoning_tokens"] > 0 and 0 < x["reasoning_tokens"] < x["answer_tokens"]
    assert 0 < s["reasoning_share"] < 1
    assert s["acceptance_reasoning"] is not None and s["acceptance_answer"] is not None
    md = (agent["out"] / "report.md").read_text()
    assert "- reasoning: " in md and "on reasoning (" in md and "on the final answer" in md
    assert r["verifier_loads"] == 1  # the grown conversations' new turns: one capture engine


def test_a_grown_conversation_computes_only_its_new_turn(agent):
    assert agent["earlier"]["rows_computed"] == 2 * N_TRAIN
    x = agent["report"]["extraction"]
    assert (x["rows_computed"], x["rows_reused"]) == (N_TRAIN, 2 * N_TRAIN)


def _samples(view: Path):
    """(ids, loss mask) of every sample of a view, in its order, with the row key."""
    for key in view_rows(view)["rows"]:
        for j, meta in enumerate(read_row(key)["samples"]):
            with safe_open(str(row_path(key) / f"hs_{j}.safetensors"), "pt") as f:
                yield key, f.get_tensor("token_ids").tolist(), meta["loss_mask"]


def test_captured_ids_are_what_the_template_renders_for_the_regenerated_conversation(agent):
    """Each sample: its prompt is exactly the template applied (with the row's tools) to the conversation so far with
    the verifier's own earlier answers, its answer is the verifier's; the next turn reads that answer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(agent["verifier"])
    view = Path(agent["report"]["artifacts"]["hidden_states"])
    lines = [json.loads(line) for line in (view / "responses.jsonl").read_text().splitlines()]
    answered = [r["messages"] for r in lines]
    samples = list(_samples(view))
    assert len(samples) == len(answered) == 3 * N_TRAIN and all(r["tools"] == [WEATHER] for r in lines)
    for (key, ids, mask), conv in zip(samples, answered):
        start = mask.index(1)
        context, answer = conv[:-1], conv[-1]
        assert ids[:start] == chat_ids(tok, [{"role": TOOLS, "tools": [WEATHER]}, *context], True)  # token for token
        assert tok.convert_ids_to_tokens(ids[start: start + 4]) == REASONING + ["</think>"]
        assert answer["content"] == read_row(key)["samples"][0]["response"]
    # turn t + 1 reads turn t's answer, not the data's (the data's first answer is a tool call)
    firsts = {c[0]["content"]: c[-1]["content"] for c in answered if len(c) == 2}
    seconds = [c for c in answered if len(c) == 4]
    assert len(seconds) == N_TRAIN and all(c[1]["content"] == firsts[c[0]["content"]] for c in seconds)


def test_reasoning_is_in_the_loss_by_default_and_out_when_asked(agent, tmp_path):
    """data.reasoning_in_loss=false: the same rows (every one known, no engine), a view whose masks leave the
    reasoning blocks out."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    tags = reasoning_tag_ids(AutoTokenizer.from_pretrained(agent["verifier"]), ("<think>", "</think>"))
    view = Path(agent["report"]["artifacts"]["hidden_states"])
    cfg = agent["cfg"].model_copy(update={"data": agent["cfg"].data.model_copy(update={"reasoning_in_loss": False})})
    out = tmp_path / "view"
    out.mkdir()
    stats = capture_for_run(None, resolve_verifier(str(agent["verifier"])), agent["report"]["artifacts"]["data"], out,
                            cfg, None, None)
    assert stats["rows_computed"] == 0 and not stats["reasoning_in_loss"]
    kept, dropped = load_from_disk(str(view)), load_from_disk(str(out))
    assert [i.tolist() for i in kept["input_ids"]] == [i.tolist() for i in dropped["input_ids"]]
    for ids, full, cut in zip(kept["input_ids"], kept["loss_mask"], dropped["loss_mask"]):
        ids, full, cut = ids.tolist(), full.tolist(), cut.tolist()
        start = full.index(1)
        flags = [False] * start + reasoning_flags(ids, start, tags)
        assert all(full[i] for i in range(start, len(ids)))  # by default the whole answer, reasoning included
        assert cut == [0 if f else m for m, f in zip(full, flags)] and sum(flags) >= 4 and sum(cut) > 0
