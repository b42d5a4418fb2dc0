"""The capture backend's checks that need no engine: every sampled answer's own seed (planned from the tokenizer
alone), the fleet's dealing and failover, and the backend checks made before any load."""

from __future__ import annotations

import time

import httpx
import pytest

from eaglet.capture import resolve_backend
from eaglet.capture.engine import capture_layers
from eaglet.errors import EagletError
from eaglet.verifier import resolve_verifier
from eaglet.verifier.devices import visible_accelerators
from tests.conversations import write_echo_conversations

AUX = [2, 4, 5]  # as test_capture_vllm.py's engine
LAYERS = capture_layers(AUX, 8)
MAX_SEQ, NEW = 128, 32


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return write_echo_conversations(tmp_path_factory.mktemp("vx") / "c.jsonl", 24)


def test_every_sampled_answer_has_a_seed_of_its_own(tiny_verifier, conversations, tmp_path):
    """vLLM seeds each request's generator with the request's seed, so requests with one seed draw the same noise
    at every step; answer j of every prompt once had seed + j (eaglet.capture.vllm.sample_seed). Seeds are distinct
    over rows and answers, the same for a row wherever it sits in the file, and change with data.seed."""
    from eaglet.capture.vllm import capture_settings, plan_rows
    from eaglet.data import read_conversations, write_conversations

    fingerprint = resolve_verifier(tiny_verifier, AUX).fingerprint

    def seeds(path, seed):
        settings = capture_settings(LAYERS, MAX_SEQ, "bfloat16", True, NEW, 0.7, 2, seed)
        planned, _ = plan_rows(str(tiny_verifier), path, fingerprint, settings)
        return {key: [req["seed"] for req in reqs] for key, reqs in planned.items()}

    first = seeds(conversations, 0)
    flat = [s for per in first.values() for s in per]
    assert len(first) == 24 and len(flat) == 48 == len(set(flat))
    assert all(0 <= s < 2**31 for s in flat)
    write_conversations(tmp_path / "reversed.jsonl", read_conversations(conversations)[::-1])
    assert seeds(tmp_path / "reversed.jsonl", 0) == first
    assert not set(flat) & {s for per in seeds(conversations, 1).values() for s in per}


def test_fleet_deals_requests_to_the_least_busy_engine_and_fails_over():
    """eaglet.capture.fleet on its own: requests go to the live engine with the fewest in flight; an engine whose
    transport fails is taken out and its request answered by another; with none left, one sentence."""
    from concurrent.futures import ThreadPoolExecutor

    from eaglet.capture.engine import Engine
    from eaglet.capture.fleet import EngineGone, Fleet

    a, b = (Engine(endpoint=f"http://{n}:8000", served_name="x", max_model_len=64) for n in ("a", "b"))
    fleet = Fleet([a, b])
    answered: list[tuple[str, int]] = []

    def send(engine, n):
        if engine is b and n >= 10:  # b dies after its first requests
            raise httpx.ConnectError("connection refused")
        time.sleep(0.01)
        answered.append((engine.endpoint, n))
        return n

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda n: fleet.call(send, n), range(40)))
    assert [n for _, n in results] == list(range(40))  # every request answered once, by someone
    assert sorted(n for _, n in answered) == list(range(40))
    assert {e for e, n in answered if n < 8} == {a.endpoint, b.endpoint}  # both took requests while both lived
    assert all(e == a.endpoint for e, n in answered if n >= 10)
    assert fleet.gone == {1: "ConnectError: connection refused"} and fleet.live() == [a]
    for i, _ in results:
        fleet.credit(i, 5)
    shares = fleet.shares()
    assert sum(s["rows"] for s in shares) == 40 and shares[1]["taken_out"].startswith("ConnectError")

    def broken(engine, n):
        raise EngineGone(f"{engine.endpoint} answered 503")

    with pytest.raises(EagletError, match=r"^no capture engine left \(http://a:8000: EngineGone: http://a:8000 "
                       r"answered 503; http://b:8000: ConnectError"):
        fleet.call(broken, 0)
    with pytest.raises(ValueError):  # a request refused by the engine (4xx) is the request's fault: not failed over
        Fleet([a]).call(lambda engine: (_ for _ in ()).throw(ValueError("bad request")))


@pytest.mark.skipif(visible_accelerators() > 0, reason="the checks of a machine without a GPU")
def test_backend_checks_before_any_load():
    assert resolve_backend("auto") == "vllm"  # vLLM's CPU backend: one pass, CPU included
    assert resolve_backend("auto", workers=2) == "hf"  # Dask fan-out is the hf backend's
    for kwargs, words in [
        (dict(backend="vllm", workers=2), "workers and scheduler_address"),
        (dict(backend="vllm", scheduler="tcp://10.0.0.5:8786"), "workers and scheduler_address"),
        (dict(backend="vllm", tensor_parallel_size=2), "needs that many GPUs; 0 visible"),
        (dict(backend="hf", tensor_parallel_size=8), "apply to the vllm backend"),
        (dict(backend="hf", data_parallel_size=2), "apply to the vllm backend"),
        (dict(backend="auto", device="cuda:1"), "no CUDA device is visible"),
    ]:
        with pytest.raises(EagletError, match=words):
            resolve_backend(**kwargs)
    from eaglet.capture import run_backend
    from eaglet.config import load_config

    assert run_backend(load_config(None, ["extraction.data_parallel_size=2"])) == "vllm"  # CPU: engines share cores
    with pytest.raises(EagletError, match="list the servers in verifier.endpoint"):
        run_backend(load_config(None, ["extraction.data_parallel_size=2", "verifier.endpoint=http://a:8000"]))
    for sets, words in [
        (["extraction.states=stream", "extraction.backend=hf"], "extraction.states=stream streams states from a vLLM"),
        (["extraction.disk_budget_gb=1", "extraction.workers=2"], "extraction.disk_budget_gb streams states from"),
        (["extraction.states=stream", "extraction.disk_budget_gb=1"], "with states=stream nothing is stored"),
    ]:
        with pytest.raises(EagletError, match=words):
            run_backend(load_config(None, sets))
