"""Judging a draft in vLLM: the smoke test (lossless, acceptance on held-out prompts: `smoke`), the suites it is
measured on (`suites`), and the serving payoff at each concurrency and k (`serving`). The package imports
nothing, so importing one module never runs the others."""
