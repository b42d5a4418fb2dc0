"""Several capture engines behind one data pass, with failover.

Rows are dealt one request at a time: a client thread that is free takes the next planned request and sends it
to the live engine with the fewest requests in flight, so a fast engine takes more rows than a slow one (small
leases, as SpecForge's rollout workers take a few prompts at a time). An engine that refuses connections, drops
them, times out or answers 5xx is taken out of the fleet; the request it held, and every one after it, goes to
the others. Rows are published by the one reader of the answers (eaglet.capture.vllm), once each, so a row is
never computed into the store twice, whichever engine answered it. With no engine left the pass stops with one
sentence; the rows already published stay, and a rerun computes only the rest.

N separate servers rather than vLLM's --data-parallel-size: each engine's connector writes its own files, a dead
replica would take vLLM's shared API server down with it, and the same code then serves several
`verifier.endpoint` URLs (one `eaglet verifier serve` per node).
"""

from __future__ import annotations

import threading
import time

from eaglet.errors import EagletError


class EngineGone(RuntimeError):
    """An engine that cannot answer any more (the request goes to another)."""


def engine_failures() -> tuple[type[BaseException], ...]:
    """What takes an engine out of the fleet: transport failures and EngineGone (a 5xx answer)."""
    import httpx

    return (httpx.TransportError, EngineGone)


class Fleet:
    """The engines of one data pass: which one takes a request, which are gone, and each one's share."""

    def __init__(self, engines: list) -> None:
        if not engines:
            raise ValueError("a fleet needs at least one engine")
        self.engines = list(engines)
        self._lock = threading.Lock()
        self._in_flight = [0] * len(engines)
        self.gone: dict[int, str] = {}  # engine index -> why it was taken out
        self.rows = [0] * len(engines)
        self.tokens = [0] * len(engines)
        self._t0 = time.perf_counter()

    def _take(self) -> int:
        with self._lock:
            live = [i for i in range(len(self.engines)) if i not in self.gone]
            if not live:
                why = "; ".join(f"{self.engines[i].endpoint}: {r}" for i, r in sorted(self.gone.items()))
                raise EagletError(f"no capture engine left ({why}); the rows already captured are kept: run again "
                                  "to compute the rest")
            i = min(live, key=lambda j: self._in_flight[j])
            self._in_flight[i] += 1
            return i

    def take_out(self, i: int, why: str) -> None:
        with self._lock:
            self.gone.setdefault(i, why)

    def call(self, fn, *args):
        """fn(engine, *args) on the live engine with the fewest requests in flight; on an engine failure, taken out
        and sent to the next one. Returns (engine index, result)."""
        while True:
            i = self._take()
            try:
                return i, fn(self.engines[i], *args)
            except engine_failures() as e:
                self.take_out(i, f"{type(e).__name__}: {str(e)[:200]}")
            finally:
                with self._lock:
                    self._in_flight[i] -= 1

    def credit(self, i: int, tokens: int) -> None:
        """A row published from engine i's answers."""
        with self._lock:
            self.rows[i] += 1
            self.tokens[i] += tokens

    def shares(self) -> list[dict]:
        """Each engine's share of the pass: rows, tokens, tokens/s over the pass, and whether it was taken out."""
        seconds = time.perf_counter() - self._t0
        return [{"endpoint": e.endpoint, "rows": self.rows[i], "tokens": self.tokens[i],
                 "tokens_per_s": round(self.tokens[i] / seconds, 1) if seconds else 0.0,
                 "taken_out": self.gone.get(i)} for i, e in enumerate(self.engines)]

    def live(self) -> list:
        return [e for i, e in enumerate(self.engines) if i not in self.gone]


def describe_shares(shares: list[dict]) -> str:
    """Fleet.shares() in one line (the capture log and the run report)."""
    return "; ".join(f"`{e['endpoint']}` {e['rows']} rows, {e['tokens']} tokens ({e['tokens_per_s']:.0f} tokens/s)"
                     + (f", taken out: {e['taken_out']}" if e["taken_out"] else "") for e in shares)
