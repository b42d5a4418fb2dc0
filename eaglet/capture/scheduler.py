"""The capture engine's scheduler on CPU: vLLM's own, minus the placeholder draft token of `extract_hidden_states`.

vLLM (0.32) runs the capture as speculative decoding with `num_speculative_tokens=1`: after every step the
proposer stores the step's hidden states and "proposes" the token just sampled, and the scheduler sends that
token back with the next one, so every decode step computes two positions per request and keeps one. On a GPU
the second position costs little (decoding is memory-bound); on a CPU it is compute: the verifier's forward does
about twice the work per generated token. This scheduler drops those proposals (`update_draft_token_ids`), so a
running request is scheduled like a plain one, one position per step; the proposer still runs after every
forward and stores the hidden states of every position computed, which are all the prompt's and answer's
positions. (A preempted request that resumes may still be padded with one placeholder, upstream's path.)
Loaded by vLLM's engine core through `--scheduler-cls`.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class CaptureScheduler(Scheduler):
    def update_draft_token_ids(self, draft_token_ids) -> None:
        return  # the proposer's "draft" is the token already sampled: never worth a second position

    def update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output) -> None:
        return
