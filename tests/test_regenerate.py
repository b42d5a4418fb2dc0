"""Sampled answers from vLLM's plain engine (the hf backend's regeneration), on the machine's own backend."""

from eaglet.vllm_run import run_vllm_job


def test_sampled_answers_survive_a_chunked_prefill(tiny_verifier):
    """A prompt longer than the engine's token budget per step is prefilled in chunks; vLLM then rewinds a seeded
    request's generator, which torch's CPU generator cannot do, and the CPU engine died on the first such request
    (eaglet.vllm_worker.request_seed). Two sampled answers per prompt must come back for every prompt."""
    long = " ".join(["how do bees find the flowers in a garden"] * 30)
    convs = [[{"role": "user", "content": long}], [{"role": "user", "content": "hello"}]]
    result = run_vllm_job({"verifier": str(tiny_verifier), "conversations": convs, "max_tokens": 8,
                           "max_model_len": 1024, "temperature": 0.7, "n": 2, "seed": 0, "dtype": "float32",
                           "max_num_batched_tokens": 32, "max_num_seqs": 4})
    assert [len(per) for per in result["token_ids"]] == [2, 2]
    assert all(ids for per in result["token_ids"] for ids in per)


def test_small_hosts_run_vllm_on_every_core(monkeypatch):
    """vLLM's "auto" CPU binding keeps one core for its scheduler: on 2 cores an offline engine ran the verifier
    on one (eaglet.vllm_run.cpu_threads_bind). eaglet binds all of a small host's CPUs for offline engines, and
    leaves the capture server, bigger hosts and an explicit setting alone."""
    from eaglet.vllm_run import SMALL_HOST_CPUS, cpu_threads_bind, vllm_env

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
