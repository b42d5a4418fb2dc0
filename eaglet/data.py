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
}
DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"
DEFAULT_EVAL = DEFAULT_PROMPTS.with_name("eval.jsonl")  # the shipped prompts' fixed held-out rows (a subset)


def _turns(raw: list, line_no: int, key_role: str, key_text: str) -> list[dict]:
    messages = []
    for turn in raw:
        if not isinstance(turn, dict) or key_role not in turn or key_text not in turn:
            raise EagletError(f"line {line_no}: each turn needs '{key_role}' and '{key_text}'")
        role = ROLE_ALIASES.get(str(turn[key_role]).lower())
        if role is None:
            raise EagletError(f"line {line_no}: unknown role {turn[key_role]!r} (use user/assistant/system)")
        messages.append({"role": role, "content": str(turn[key_text])})
    return messages


def normalize_row(row: object, line_no: int) -> list[dict]:
    """One JSONL row in any supported shape -> a list of {role, content} messages."""
    if not isinstance(row, dict):
        raise EagletError(f"line {line_no}: expected a JSON object, got {type(row).__name__}")
    if isinstance(row.get("conversations"), list):
        conv = row["conversations"]
        if conv and isinstance(conv[0], dict) and "from" in conv[0]:
            return _turns(conv, line_no, "from", "value")
        return _turns(conv, line_no, "role", "content")
    if isinstance(row.get("messages"), list):
        return _turns(row["messages"], line_no, "role", "content")
    if isinstance(row.get("prompt"), str):
        msgs = [{"role": "user", "content": row["prompt"]}]
        if isinstance(row.get("response"), str):
            msgs.append({"role": "assistant", "content": row["response"]})
        return msgs
    raise EagletError(
        f"line {line_no}: unknown row shape with keys {sorted(row)}; expected 'conversations' (ShareGPT), "
        "'messages' (OpenAI) or 'prompt'"
    )


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
    """Write conversations as OpenAI-shaped JSONL rows ({"messages": [...]}), readable by read_conversations."""
    with path.open("w") as f:
        for msgs in rows:
            f.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")


def assistant_mask(tokenizer, messages: list[dict], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Token ids of the templated conversation and a 0/1 mask that is 1 exactly on assistant tokens.

    Each assistant turn spans from the end of the templated prefix with a generation prompt to the end of the
    templated prefix including that turn. This needs only the (near universal) prefix property of chat
    templates, which is checked, not assumed.
    """
    def ids(msgs, gen_prompt):
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen_prompt, return_dict=False)
        return list(out["input_ids"] if isinstance(out, dict) else out)

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
