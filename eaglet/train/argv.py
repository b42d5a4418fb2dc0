"""Reading a speculators argv (what eaglet.train.launch builds and a draft artifact records)."""

from __future__ import annotations


def argv_values(argv: list[str], flag: str) -> list[str]:
    """The values after `flag` in a speculators argv (up to the next flag)."""
    i = argv.index(flag) + 1
    j = next((k for k in range(i, len(argv)) if argv[k].startswith("--")), len(argv))
    return argv[i:j]


def argv_value(argv: list[str], flag: str) -> str:
    return argv_values(argv, flag)[0]
