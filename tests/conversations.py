"""Conversations the tests train on without generating: no vLLM needed."""

from __future__ import annotations

import json
from pathlib import Path

from eaglet.data import DEFAULT_PROMPTS, write_conversations


def write_echo_conversations(path: Path, n: int, prompts: Path = DEFAULT_PROMPTS) -> Path:
    """n conversations from `prompts` (the shipped ones), each answered with its words reversed."""
    rows = []
    for line in prompts.read_text().splitlines()[:n]:
        prompt = json.loads(line)["prompt"]
        rows.append([{"role": "user", "content": prompt},
                     {"role": "assistant", "content": " ".join(reversed(prompt.lower().split()))}])
    write_conversations(path, rows)
    return path


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CITIES = ["paris", "tokyo", "lima", "oslo"]


def agent_rows(n: int, offset: int = 0, prompts: Path = DEFAULT_PROMPTS, turns: int = 3) -> list[dict]:
    """n agent conversations (raw JSONL rows) from the shipped prompts: a tool call, its result, an answer, a
    follow-up question and its answer (three assistant turns; `turns` keeps the first ones). Every third row is
    in ShareGPT's function-call shape (function_call / observation turns, tools as a JSON string), the others in
    OpenAI's."""
    rows = []
    for i, line in enumerate(prompts.read_text().splitlines()[offset: offset + n]):
        prompt, city = json.loads(line)["prompt"], CITIES[i % len(CITIES)]
        call = {"name": "get_weather", "arguments": {"city": city}}
        if i % 3 == 2:
            conv = [{"from": "human", "value": f"{prompt} what is the weather in {city}"},
                    {"from": "function_call", "value": json.dumps(call)},
                    {"from": "observation", "value": f"sunny and 20 degrees in {city}"},
                    {"from": "gpt", "value": f"it is sunny in {city}"},
                    {"from": "human", "value": "and tomorrow"}, {"from": "gpt", "value": "rain"}]
            rows.append({"conversations": conv[: 2 * turns], "tools": json.dumps([WEATHER])})
            continue
        messages = [{"role": "user", "content": f"{prompt} what is the weather in {city}"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": f"call{i}", "type": "function",
                         "function": {"name": "get_weather", "arguments": json.dumps(call["arguments"])}}]},
                    {"role": "tool", "tool_call_id": f"call{i}", "content": f"sunny and 20 degrees in {city}"},
                    {"role": "assistant", "content": f"it is sunny in {city}"},
                    {"role": "user", "content": "and tomorrow"}, {"role": "assistant", "content": "rain"}]
        rows.append({"messages": messages[: 2 * turns], "tools": [WEATHER]})
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
