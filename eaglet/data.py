"""Conversations in, tokenized training samples out.

Stage 1: read JSONL in the common shapes, normalise to OpenAI-style messages, and hold out an evaluation
split that depends on each row's content alone (or a fixed eval file). Stage 2 (`tokenize_conversations`): apply the verifier's chat template, mask the
loss to assistant tokens, truncate, and count token frequencies over the loss-masked tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

from eaglet.errors import EagletError

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "bot": "assistant", "chatgpt": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",  # tool results
    "function_call": "assistant",  # ShareGPT's tool call turn: its value is the call (or a list of calls) as JSON
}
TOOLS = "tools"  # a conversation's tool list travels as a leading {"role": "tools", "tools": [...]} entry
DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"
DEFAULT_EVAL = DEFAULT_PROMPTS.with_name("eval.jsonl")  # the shipped prompts' fixed held-out rows (a subset)


def _json(value, what: str):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise EagletError(f"{what} is not valid JSON") from None
    return value


def _tools(raw, line_no: int) -> list[dict]:
    """A row's tools in the OpenAI shape ({"type": "function", "function": {"name", ...}}), from that shape, a
    bare function ({"name", ...}), or either as a JSON string (ShareGPT files)."""
    tools = _json(raw, f"line {line_no}: 'tools'")
    if not isinstance(tools, list):
        raise EagletError(f"line {line_no}: 'tools' must be a list of functions")
    out = []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EagletError(f"line {line_no}: each of 'tools' needs a function with a 'name'")
        out.append({"type": "function", "function": fn})
    return out


def _calls(raw, where: str) -> list[dict]:
    """Tool calls in the OpenAI shape with their arguments as a JSON object (what chat templates render)."""
    calls = _json(raw, f"{where}: the tool call")
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls:
        raise EagletError(f"{where}: tool_calls must be a non-empty list of calls")
    out = []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EagletError(f"{where}: each tool call needs a function 'name'")
        args = fn.get("arguments", {})
        args = _json(args, f"{where}: the arguments of tool call {fn['name']!r}")
        if not isinstance(args, dict):
            raise EagletError(f"{where}: the arguments of tool call {fn['name']!r} are not a JSON object")
        out.append({**({"id": str(call["id"])} if call.get("id") is not None else {}), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _turns(raw: list, line_no: int, key_role: str, key_text: str) -> list[dict]:
    messages = []
    for n, turn in enumerate(raw, 1):
        where = f"line {line_no} turn {n}"
        if not isinstance(turn, dict) or key_role not in turn:
            raise EagletError(f"line {line_no}: each turn needs '{key_role}' and '{key_text}'")
        name = str(turn[key_role]).lower()
        role = ROLE_ALIASES.get(name)
        if role is None:
            raise EagletError(f"line {line_no}: unknown role {turn[key_role]!r} (use user/assistant/system/tool)")
        if name == "function_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": _calls(turn.get(key_text), where)})
            continue
        calls = turn.get("tool_calls") if role == "assistant" else None
        if turn.get(key_text) is None and not calls:
            raise EagletError(f"line {line_no}: each turn needs '{key_role}' and '{key_text}'")
        msg = {"role": role, "content": "" if turn.get(key_text) is None else str(turn[key_text])}
        if calls:
            msg["tool_calls"] = _calls(calls, where)
        if role == "assistant" and isinstance(turn.get("reasoning_content"), str):
            msg["reasoning_content"] = turn["reasoning_content"]
        if role == "tool":
            msg.update({k: str(turn[k]) for k in ("tool_call_id", "name") if turn.get(k) is not None})
        messages.append(msg)
    return messages


def _check_tool_turns(messages: list[dict], tools: list[dict] | None, line_no: int) -> None:
    """Each tool call names a tool of the row's list, and each tool result answers a call before it."""
    names = [t["function"]["name"] for t in tools or []]
    open_calls: list[dict] = []
    for n, m in enumerate(messages, 1):
        where = f"line {line_no} turn {n}"
        if m["role"] == "assistant":
            open_calls = list(m.get("tool_calls", []))
            for call in open_calls:
                name = call["function"]["name"]
                if name not in names:
                    listed = f"the row's tools are {names}" if names else "the row lists no 'tools'"
                    raise EagletError(f"{where} calls tool {name!r}, which is unknown ({listed})")
        elif m["role"] == "tool":
            if not open_calls:
                raise EagletError(f"{where} is a tool result with no tool call before it to answer")
            ids, answered = [c.get("id") for c in open_calls], m.get("tool_call_id")
            if answered is not None and answered not in ids:
                raise EagletError(f"{where} answers tool call id {answered!r}, which no open call has")
            open_calls.pop(ids.index(answered) if answered is not None else 0)
        else:
            open_calls = []


def normalize_row(row: object, line_no: int) -> list[dict]:
    """One JSONL row in any supported shape -> a list of {role, content} messages (assistant turns may carry
    tool_calls; tool results are the "tool" role), led by {"role": "tools", ...} when the row lists tools."""
    if not isinstance(row, dict):
        raise EagletError(f"line {line_no}: expected a JSON object, got {type(row).__name__}")
    if isinstance(row.get("conversations"), list):
        conv = row["conversations"]
        if conv and isinstance(conv[0], dict) and "from" in conv[0]:
            messages = _turns(conv, line_no, "from", "value")
        else:
            messages = _turns(conv, line_no, "role", "content")
    elif isinstance(row.get("messages"), list):
        messages = _turns(row["messages"], line_no, "role", "content")
    elif isinstance(row.get("prompt"), str):
        messages = [{"role": "user", "content": row["prompt"]}]
        if isinstance(row.get("response"), str):
            messages.append({"role": "assistant", "content": row["response"]})
    else:
        raise EagletError(
            f"line {line_no}: unknown row shape with keys {sorted(row)}; expected 'conversations' (ShareGPT), "
            "'messages' (OpenAI) or 'prompt'"
        )
    tools = _tools(row["tools"], line_no) if row.get("tools") not in (None, "", []) else None
    _check_tool_turns(messages, tools, line_no)
    return ([{"role": TOOLS, "tools": tools}] if tools else []) + messages


def tools_of(messages: list[dict]) -> list[dict] | None:
    return messages[0]["tools"] if messages and messages[0]["role"] == TOOLS else None


def chat_messages(messages: list[dict]) -> list[dict]:
    """The messages a chat template renders (the tools entry is its `tools=` argument)."""
    return messages[1:] if tools_of(messages) is not None else messages


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool,
             template_kwargs: dict | None = None) -> list[int]:
    """The verifier's chat template applied to a conversation (its tools, data.chat_template_kwargs): the one
    rendering capture, the loss masks, the smoke test and the evaluation's prompts all use."""
    out = tokenizer.apply_chat_template(chat_messages(messages), tools=tools_of(messages), tokenize=True,
                                        add_generation_prompt=add_generation_prompt, return_dict=False,
                                        **(template_kwargs or {}))
    return list(out["input_ids"] if isinstance(out, dict) else out)


# Variables every chat template may read that are not a template setting (transformers passes them itself).
_TEMPLATE_GIVENS = {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                    "pad_token", "unk_token", "raise_exception", "strftime_now", "tojson"}


def template_variables(tokenizer) -> set[str] | None:
    """The names a verifier's chat template reads from outside (None: it has none, or it could not be parsed)."""
    src = tokenizer.chat_template
    if isinstance(src, dict):
        src = "\n".join(src.values())
    if not src:
        return None
    from jinja2 import meta

    try:  # transformers' own environment: its extensions ({% generation %}, loop controls) parse
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(src).environment
    except Exception:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    from jinja2 import nodes

    try:
        tree = env.parse(src)
    except Exception:
        return None
    # a name set inside a block ({% if %}{% set x %}) is still "undeclared" to jinja: the template's own, not a setting
    assigned = {n.name for node in tree.find_all((nodes.Assign, nodes.For))
                for n in [node.target, *node.target.find_all(nodes.Name)] if isinstance(n, nodes.Name)}
    return set(meta.find_undeclared_variables(tree)) - assigned


def check_rendering(tokenizer, rows: list[list[dict]], template_kwargs: dict, what: str) -> None:
    """Before any load: every template setting is read by the verifier's template, and rows with tools or tool
    calls meet a template that renders them (else they would be silently left out of what the verifier sees)."""
    names = template_variables(tokenizer)
    if names is not None:
        for key in template_kwargs:
            if key not in names:
                reads = sorted(names - _TEMPLATE_GIVENS)
                raise EagletError(f"data.chat_template_kwargs sets {key!r}, which the verifier's chat template never "
                                  f"reads (it reads {reads or 'no setting'}): fix the name or drop it")
    src = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    for n, messages in enumerate(rows, 1):
        if tools_of(messages) and names is not None and "tools" not in names:
            raise EagletError(f"{what} row {n} lists tools, but the verifier's chat template does not render tools "
                              "(it never reads `tools`): use a verifier whose template does, or drop the tools")
        if any(m.get("tool_calls") for m in messages) and "tool_calls" not in src:
            raise EagletError(f"{what} row {n} has tool calls, but the verifier's chat template does not render "
                              "assistant tool_calls: use a verifier whose template does, or drop those turns")


def check_template_settings(tokenizer, rows_by_file: dict, template_kwargs: dict, reasoning_tags, reasoning_in_loss: bool,
                            ) -> None:
    """A run's conversations against the verifier's template (check_rendering, each file), and reasoning left out
    of the loss only where the verifier has one-token reasoning tags: before any load."""
    for name, rows in rows_by_file.items():
        check_rendering(tokenizer, rows, template_kwargs, str(name))
    if not reasoning_in_loss and reasoning_tag_ids(tokenizer, reasoning_tags) is None:
        raise EagletError(f"data.reasoning_in_loss=false needs data.reasoning_tags {list(reasoning_tags)} to be one "
                          "token each in the verifier's vocabulary, and they are not: set the verifier's own tags")


def reasoning_tag_ids(tokenizer, tags: tuple[str, str] | list[str]) -> tuple[int, int] | None:
    """The token ids of data.reasoning_tags, or None when either is not one token of the verifier's vocabulary."""
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in tags]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def reasoning_flags(ids: list[int], start: int, tag_ids: tuple[int, int] | None) -> list[bool]:
    """For each token from `start` on (an answer), whether it is in a reasoning block, its tags included; a block
    the prompt opened (a template whose generation prompt ends in the open tag) counts from `start`."""
    if tag_ids is None:
        return [False] * (len(ids) - start)
    open_id, close_id = tag_ids
    inside = next((t == open_id for t in reversed(ids[:start]) if t in tag_ids), False)
    flags = []
    for t in ids[start:]:
        if t == open_id:
            inside = True
        flags.append(inside)
        if t == close_id:
            inside = False
    return flags


def reasoning_end(answer: list[int], prompt: list[int], tag_ids: tuple[int, int] | None) -> int:
    """How many leading tokens of an answer are its reasoning block (0 when it does not open with one)."""
    flags = reasoning_flags(prompt + answer, len(prompt), tag_ids)
    n = 0
    while n < len(flags) and flags[n]:
        n += 1
    return n


def read_conversations(path: str | Path) -> list[list[dict]]:
    path = Path(path)
    if not path.is_file():
        raise EagletError(f"dataset {path} does not exist")
    rows = []
    with path.open("rb") as f:
        for line_no, line in _lines(f, path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise EagletError(f"dataset {path} line {line_no} is not valid JSON: {e.msg}") from None
            msgs = normalize_row(row, line_no)
            if not any(m["role"] == "user" for m in msgs):
                raise EagletError(f"dataset {path} line {line_no} has no user turn")
            rows.append(msgs)
    if not rows:
        raise EagletError(f"dataset {path} is empty")
    return rows


def _lines(f, path: Path):
    """Numbered lines of a text file read as bytes; a line that is not UTF-8 is one sentence, not a traceback."""
    for line_no, raw in enumerate(f, 1):
        try:
            yield line_no, raw.decode("utf-8")
        except UnicodeDecodeError:
            raise EagletError(f"dataset {path} line {line_no} is not UTF-8 text: save the file as UTF-8 JSONL") from None


def prompt_part(messages: list[dict]) -> list[dict]:
    """The context a response is generated for: everything before the last assistant turn."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    return messages if last is None else messages[:last]


def row_digest(messages: list[dict]) -> str:
    """A conversation's identity: the digest of its normalised messages (whatever shape its line had)."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:20]


def prompt_digest(messages: list[dict]) -> str:
    """A prompt's identity: what the held-out split, the smoke test and a draft's lineage compare."""
    return row_digest(prompt_part(messages))


def prompt_digests(path: str | Path) -> set[str]:
    return {prompt_digest(m) for m in read_conversations(path)}


def held_out_file(rows: list[list[dict]], eval_path: str | None, data_path: str | None) -> str | None:
    """The fixed held-out file of a run, or None for the digest split.

    data.eval_path when given; else the shipped held-out rows for the shipped prompts and for any file that holds
    one of those prompts (a file grown from the shipped prompts): a digest split there would move shipped held-out
    prompts into training and hold out prompts that earlier drafts trained on. Any other file: the digest split,
    under which appending rows never moves an old one."""
    if eval_path:
        return eval_path
    if data_path is None:
        return str(DEFAULT_EVAL)
    shipped = prompt_digests(DEFAULT_EVAL)
    return str(DEFAULT_EVAL) if any(prompt_digest(m) in shipped for m in rows) else None


def held_out(messages: list[dict], seed: int, fraction: float) -> bool:
    """Whether a row is held out: a function of its prompt's digest and the seed alone, so adding, removing or
    reordering other rows never moves it between train and eval (two answers to one prompt stay together)."""
    h = hashlib.sha256(f"{seed}:{prompt_digest(messages)}".encode()).hexdigest()
    return int(h[:15], 16) / 16**15 < fraction


def split_conversations(rows: list[list[dict]], eval_fraction: float, seed: int, max_samples: int | None = None,
                        eval_rows: list[list[dict]] | None = None) -> tuple[list[list[dict]], list[list[dict]], dict]:
    """(train, held out, counts). Rows are deduplicated and sorted by digest, so the split and the order do not
    depend on the file's order. With `eval_rows` (a fixed eval file) those are the held-out set and any training
    row with one of their prompts is dropped (the held-out prompts stay unseen)."""
    unique = {row_digest(m): m for m in rows}
    counts = {"rows": len(rows), "duplicates": len(rows) - len(unique), "eval_overlap": 0}
    ordered = [unique[d] for d in sorted(unique)]
    if eval_rows is not None:
        held = sorted(eval_rows, key=row_digest)
        eval_prompts = {prompt_digest(m) for m in held}
        train = [m for m in ordered if prompt_digest(m) not in eval_prompts]
        counts["eval_overlap"] = len(ordered) - len(train)
    else:
        held = [m for m in ordered if held_out(m, seed, eval_fraction)]
        train = [m for m in ordered if not held_out(m, seed, eval_fraction)]
        if not held:
            raise EagletError(f"no row of {len(ordered)} falls in the held-out split (data.eval_fraction="
                              f"{eval_fraction}); raise data.eval_fraction or give a fixed data.eval_path")
    if not train:
        raise EagletError("no training row is left after holding out the evaluation rows; add rows or lower "
                          "data.eval_fraction")
    if max_samples is not None:
        train = train[:max_samples]
    counts.update(train=len(train), eval=len(held))
    return train, held, counts


def check_has_responses(rows: list[list[dict]]) -> None:
    missing = sum(1 for msgs in rows if not any(m["role"] == "assistant" for m in msgs))
    if missing:
        raise EagletError(
            f"{missing} training rows have no assistant turn; set data.regenerate=true to answer them with the verifier"
        )


def write_conversations(path: Path, rows: list[list[dict]]) -> None:
    """Write conversations as OpenAI-shaped JSONL rows ({"messages": [...], "tools"?}), readable by
    read_conversations."""
    with path.open("w") as f:
        for msgs in rows:
            row = {"messages": chat_messages(msgs)} | ({"tools": tools_of(msgs)} if tools_of(msgs) else {})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def assistant_mask(tokenizer, messages: list[dict], max_seq_len: int,
                   template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the templated conversation and a 0/1 mask that is 1 exactly on assistant tokens.

    Each assistant turn spans from the end of the templated prefix with a generation prompt to the end of the
    templated prefix including that turn. This needs only the (near universal) prefix property of chat
    templates, which is checked, not assumed.
    """
    def ids(msgs, gen_prompt):
        return chat_ids(tokenizer, msgs, gen_prompt, template_kwargs)

    full = ids(messages, False)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(ids(messages[:i], True))
        end_ids = ids(messages[: i + 1], False)
        if full[: len(end_ids)] != end_ids:
            raise EagletError("the verifier's chat template is not prefix-stable; assistant loss masks cannot be derived")
        for t in range(start, len(end_ids)):
            mask[t] = 1
    return full[:max_seq_len], mask[:max_seq_len]


def tokenize_conversations(tokenizer, rows: list[list[dict]], max_seq_len: int) -> tuple[list[dict], Counter]:
    """Samples with input_ids / loss_mask / seq_len, and token counts over loss-masked tokens."""
    samples, freq = [], Counter()
    for msgs in rows:
        input_ids, mask = assistant_mask(tokenizer, msgs, max_seq_len)
        if sum(mask) == 0:
            continue  # nothing to learn from (truncated away)
        samples.append({"input_ids": input_ids, "loss_mask": mask, "seq_len": len(input_ids)})
        freq.update(t for t, m in zip(input_ids, mask) if m)
    if not samples:
        raise EagletError("no training sample keeps an assistant token after truncation; raise data.max_seq_len")
    return samples, freq


def split_run_rows(data_file: str | Path, eval_path: str | None, data_path: str | None, eval_fraction: float, seed: int,
                   max_samples: int | None) -> tuple[list, list, dict, str | None]:
    """A run's rows: (training, held out, counts, the fixed held-out file or None). held_out_file chooses the file
    (data.eval_path, or the shipped data/eval.jsonl for a file that holds a shipped held-out prompt); otherwise the
    digest split holds out eval_fraction."""
    rows = read_conversations(data_file)
    held_file = held_out_file(rows, eval_path, data_path)
    held = read_conversations(held_file) if held_file else None
    return (*split_conversations(rows, eval_fraction, seed, max_samples, held), held_file)


def write_split(out: Path, train_rows: list[list[dict]], held_out: list[list[dict]], counts: dict) -> None:
    """The data artifact: train.jsonl, eval.jsonl (the held-out rows) and stats.json (what was dropped)."""
    write_conversations(out / "train.jsonl", train_rows)
    write_conversations(out / "eval.jsonl", held_out)
    (out / "stats.json").write_text(json.dumps(counts))


def split_summary(n_train: int, n_held: int, counts: dict, held_file: str | None, data_file: str, params) -> str:
    """The split in a log line: rows each side, what was dropped, and where the held-out rows come from."""
    dropped = ", ".join(f"{counts[k]} {k.replace('_', ' ')}" for k in ("duplicates", "eval_overlap") if counts[k])
    line = f"{n_train} training and {n_held} held-out conversations" + (f" (dropped: {dropped})" if dropped else "")
    if held_file and not params.eval_path and params.path:
        line += (f"; {data_file} holds shipped prompts: its held-out rows are the shipped {held_file} "
                 "(data.eval_path chooses others)")
    return line
