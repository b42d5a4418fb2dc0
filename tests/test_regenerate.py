"""Sampled answers from vLLM's plain engine (the hf backend's regeneration), on the machine's own backend."""

import pytest

from eaglet.vllm import run_job


@pytest.mark.e2e  # an offline vLLM engine
def test_sampled_answers_survive_a_chunked_prefill(tiny_verifier):
    """A prompt longer than the engine's token budget per step is prefilled in chunks; vLLM then rewinds a seeded
    request's generator, which torch's CPU generator cannot do, and the CPU engine died on the first such request
    (eaglet.vllm.worker.request_seeds). Two sampled answers per prompt must come back for every prompt."""
    long = " ".join(["how do bees find the flowers in a garden"] * 30)
    convs = [[{"role": "user", "content": long}], [{"role": "user", "content": "hello"}]]
    result = run_job({"verifier": str(tiny_verifier), "conversations": convs, "max_tokens": 8,
                           "max_model_len": 1024, "temperature": 0.7, "n": 2, "seed": 0, "dtype": "float32",
                           "max_num_batched_tokens": 32, "max_num_seqs": 4})
    assert [len(per) for per in result["token_ids"]] == [2, 2]
    assert all(ids for per in result["token_ids"] for ids in per)


def test_sampled_conversations_get_seeds_of_their_own(monkeypatch):
    """One seed for every request would give every prompt the same sampling noise at each step (vLLM seeds a
    request's generator with it). Sampled conversations get their own seed from the job's seed and the
    conversation; on vLLM's CPU backend none (its engine generator then draws for each); greedy ones the job's."""
    from vllm.platforms import current_platform

    from eaglet.vllm.worker import request_seeds

    convs = [[{"role": "user", "content": f"question {i}"}] for i in range(64)]
    job = {"conversations": convs, "temperature": 0.7, "n": 2, "seed": 0}
    assert request_seeds(dict(job, temperature=0.0)) == [0] * 64
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    assert request_seeds(job) == [None] * 64
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    seeds = request_seeds(job)
    assert len(set(seeds)) == 64 and all(0 <= s and s + 2 < 2**31 for s in seeds)
    assert request_seeds(dict(job, conversations=convs[::-1])) == seeds[::-1]  # a conversation's, not its place's
    assert not set(seeds) & set(request_seeds(dict(job, seed=1)))


def test_small_hosts_run_vllm_on_every_core(monkeypatch):
    """vLLM's "auto" CPU binding keeps one core for its scheduler: on 2 cores an offline engine ran the verifier
    on one (eaglet.vllm.run.cpu_threads_bind). eaglet binds all of a small host's CPUs for offline engines, and
    leaves the capture server, bigger hosts and an explicit setting alone."""
    from eaglet.vllm import SMALL_HOST_CPUS, cpu_threads_bind, vllm_env

    assert cpu_threads_bind({0, 1}) == "0,1"
    assert cpu_threads_bind({3, 1}) == "1,3"  # the affinity mask, not 0..n-1
    assert cpu_threads_bind(set(range(SMALL_HOST_CPUS + 1))) is None
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert vllm_env(all_cores=True)["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env()  # the capture server
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert vllm_env(all_cores=True)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env(all_cores=True)
