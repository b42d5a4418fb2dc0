"""vLLM in child processes, the one interface capture, regeneration, smoke and the bench use: a job runner
(run.run_job), the worker's job protocol (worker.serve, its spec-decode counters), the process-group stopper
(process.stop_group), a server's port and health (server.free_port, server.healthy), a server under vLLM's serving
benchmark (serving) and the environment of a vLLM child (run.vllm_env). vLLM itself is imported only in the
children: it spawns workers and holds most of the machine's memory."""

from eaglet.vllm.process import stop_group
from eaglet.vllm.run import SMALL_HOST_CPUS, VLLMError, cpu_threads_bind, run_job, vllm_env

__all__ = ["SMALL_HOST_CPUS", "VLLMError", "cpu_threads_bind", "run_job", "stop_group", "vllm_env"]
