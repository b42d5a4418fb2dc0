"""The acceptance length vLLM will measure, predicted from speculators' validation rows by simulating decoding.

speculators' validation reports full_acc_k: over *every* response position, the share where TTT steps 0..k were
all right. Averaged that way, 1 + sum_k full_acc_k (`position_average`) over-predicts vLLM, for two reasons
(measured in docs/experiments.md):

- Chain decoding drafts only from the position after the previous step's end. Most steps start right after a
  rejection, where the draft is right less often than on average.
- speculators scores against the verifier's best token *inside the draft vocabulary*; vLLM rejects a token the
  draft cannot propose, so those positions count as wrong here.

So we run the trained draft over speculators' own validation split (the same loader, packing and model class it
validated with), record each TTT step's predictions, and walk each row the way vLLM decodes greedily: a step
starting at j accepts the longest run of right steps L (at most ttt_steps) and the next step starts at j + L + 1.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch

from eaglet.train.argv import argv_value, argv_values
from eaglet.train.stream import StoredDtypeTransfer


def _record_steps():
    """speculators' eagle3 metrics call compute_accuracy_single_step(pred_ids, target_ids, loss_mask, prev) once
    per TTT step; we keep each step's predictions and targets, in the model's own alignment of step k."""
    import speculators.models.eagle3.metrics as metrics

    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    upstream = metrics.compute_accuracy_single_step

    def recording(pred_ids, target_ids, loss_mask, prev_correct):
        steps.append((pred_ids[0].clone(), target_ids[0].clone()))
        return upstream(pred_ids, target_ids, loss_mask, prev_correct)

    @contextlib.contextmanager
    def patched():
        metrics.compute_accuracy_single_step = recording
        try:
            yield steps
        finally:
            metrics.compute_accuracy_single_step = upstream

    return patched()


def walk(right: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """Greedy chain decoding over one row. right[k, j]: step k of a draft started at j is right (k = 0..K-1);
    mask[j]: j is a response position. Returns the accepted run length of every step."""
    full = right.cumprod(0).bool()  # steps 0..k all right from start j
    where = mask.nonzero()[:, 0]
    if len(where) == 0:
        return []
    runs, j, last = [], int(where[0]), int(where[-1])
    while j <= last:
        run = int(full[:, j].sum())
        runs.append(run)
        j += run + 1
    return runs


def simulate(checkpoint: Path, argv: list[str], max_rows: int = 2000, stream: dict | None = None) -> dict | None:
    """Chain-decoding acceptance of the speculators checkpoint `checkpoint` (an epoch directory) on the validation
    split of the training run `argv` (speculators' train argv). None when the states are stored in a format this
    reader does not open (fp8). stream: the engine that computes streamed samples (eaglet.train.stream)."""
    import numpy as np
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader


    if "--hidden-states-backend" in argv:
        return None
    verifier, ttt = argv_value(argv, "--verifier-name-or-path"), int(argv_value(argv, "--ttt-steps"))
    total_seq_len = int(argv_value(argv, "--total-seq-len"))
    d2t = torch.from_numpy(np.load(argv_value(argv, "--d2t-path")))
    t2d = torch.from_numpy(np.load(argv_value(argv, "--t2d-path"))).bool()
    config = Eagle3DraftModel.config_class.from_pretrained(str(checkpoint))
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(str(checkpoint), config=config, t2d=t2d, d2t=d2t, verifier=verifier)
    model = model.float().eval()
    online = {}
    if stream:
        from hs_connectors.transfer import FileTransfer


        transfer = StoredDtypeTransfer(FileTransfer(Path(argv_value(argv, "--data-path")) / "hidden_states"),
                                       stream["dtype"])
        online = {"on_missing": "generate", "vllm_endpoint": argv_value(argv, "--vllm-endpoint"),
                  "model": stream["served_name"], "transfer": transfer}
    rows = ArrowDataset(max_len=total_seq_len, datapath=argv_value(argv, "--data-path"),
                        **({"on_missing": "raise", "model": verifier} | online),
                        train_ratio=float(argv_value(argv, "--train-data-ratio")), split="val",
                        hidden_states_dtype=torch.float32)
    loader = _setup_dataloader(rows, total_seq_len, config.transformer_layer_config.hidden_size, num_workers=0,
                               num_target_layers=len(argv_values(argv, "--target-layer-ids")), prefetch_factor=None,
                               preprocess=shift_batch)
    _, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn=argv_value(argv, "--loss-fn"), loss_implementation="eager", ttt_steps=ttt,
        ttt_step_loss_decay=float(argv_value(argv, "--ttt-step-loss-decay")))

    runs: dict[str, list[int]] = {"all": [], "in_vocab": []}
    right_at, n_positions, n_rows = np.zeros(ttt), 0, 0  # the position average, for comparison
    with _record_steps() as steps, torch.no_grad():
        for batch in loader:
            if n_rows >= max_rows:
                break
            steps.clear()
            batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
            model(**batch, **val_kwargs)
            ids, mask, doc = batch["input_ids"][0], batch["loss_mask"][0].bool(), batch["document_ids"][0]
            n = ids.shape[0]
            # in the draft vocabulary: the token the verifier emitted next (position i predicts ids[i + 1])
            in_vocab = torch.zeros(n, dtype=torch.bool)
            in_vocab[:-1] = t2d[ids[1:]]
            right = torch.zeros(ttt, n, dtype=torch.bool)  # right[k, j]: step k of a draft started at j
            vocab = torch.zeros(ttt, n, dtype=torch.bool)  # ... and its token is one the draft can propose
            for k, (pred, target) in enumerate(steps):
                right[k, : n - k] = (pred == target) & mask[k:]
                vocab[k, : n - k] = in_vocab[k:]
            for d in doc.unique().tolist():
                if d < 0:
                    continue
                span = (doc == d).nonzero()[:, 0]
                s, e = int(span[0]), int(span[-1]) + 1
                r, m = right[:, s:e], mask[s:e]
                runs["all"] += walk(r, m)
                runs["in_vocab"] += walk(r & vocab[:, s:e], m)
                right_at += r.cumprod(0).bool()[:, m].float().sum(1).numpy()
                n_positions += int(m.sum())
                n_rows += 1
    if not runs["all"]:
        return None
    out = {"rows": n_rows, "positions": n_positions, "ttt_steps": ttt,
           "position_average": 1.0 + float(right_at.sum()) / n_positions}
    for name, key in (("all", "chain"), ("in_vocab", "chain_in_vocab")):
        accepted = np.array(runs[name])
        out[key] = float((accepted + 1).mean())
        out[f"{key}_per_position"] = [float((accepted >= k + 1).mean()) for k in range(ttt)]
    return out


def write(checkpoint: Path, argv: list[str], out: Path, stream: dict | None = None) -> dict | None:
    result = simulate(checkpoint, argv, stream=stream)
    if result is not None:
        out.write_text(json.dumps(result))
    return result


def position_average(val_metrics: Mapping[str, float]) -> float | None:
    """1 + the sum over draft positions k of speculators' full_acc_k (the share of all response positions where
    steps 0..k were all right): speculators' own validation figure, which picks the delivered epoch. It
    over-predicts vLLM (see this module's docstring); `simulate` walks the rows as vLLM decodes instead."""
    accs = [v for k, v in val_metrics.items() if k.startswith("full_acc_")]
    return 1.0 + sum(accs) if accs else None
