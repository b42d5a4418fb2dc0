"""eaglet: train EAGLE-3 drafts with speculators and ship them to vLLM."""

# Part of every artifact key: bump when a stage's output for the same inputs changes.
CODE_VERSION = "1"
