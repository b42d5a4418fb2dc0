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
