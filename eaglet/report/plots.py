"""PNG plots for the run report: training loss and accuracy per TTT step, acceptance per draft position."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and workers
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402


def _ttt_steps(rows: list[dict], prefix: str) -> list[int]:
    steps = set()
    for r in rows:
        for k in r["metrics"]:
            tail = k.removeprefix(prefix + "_").removesuffix("_epoch")
            if k.startswith(prefix + "_") and tail.isdigit():
                steps.add(int(tail))
    return sorted(steps)


def _series(rows: list[dict]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(label, metric name) of the loss and accuracy curves: per TTT step for eagle3 (loss_i, full_acc_i), one loss
    and per block position for dflash (loss, position_i_acc)."""
    steps = _ttt_steps(rows, "loss")
    losses = [(f"TTT step {i}", f"loss_{i}") for i in steps] or [("loss", "loss")]
    accs = [(f"TTT step {i}", f"full_acc_{i}") for i in _ttt_steps(rows, "full_acc")]
    positions = sorted({int(k.split("_")[1]) for r in rows for k in r["metrics"]
                        if k.startswith("position_") and k.split("_")[1].isdigit()})
    return losses, accs or [(f"block position {i}", f"position_{i}_acc") for i in positions]


def training_curves(metrics: list[dict], out: Path) -> Path | None:
    """metrics: eaglet.train.read_metrics rows. Left: training loss per step for each TTT step (validation
    loss per epoch as markers); right: validation full accuracy per epoch for each TTT step (a DFlash draft: one
    loss, accuracy per block position)."""
    last: dict[tuple, dict] = {}
    for r in metrics:  # a resumed run logs the redone steps again: the last record wins
        last[(r["kind"], r["step"] if r["kind"] == "train" else r["epoch"])] = r
    train = sorted((r for r in last.values() if r["kind"] == "train"), key=lambda r: r["step"])
    val = sorted((r for r in last.values() if r["kind"] == "val"), key=lambda r: r["epoch"])
    if not train and not val:
        return None
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=90)
    epoch_end = {}  # validation runs after an epoch's last step: plot it there
    for r in train:
        epoch_end[r["epoch"]] = max(epoch_end.get(r["epoch"], 0), r["step"])
    val_at = [r for r in val if r["epoch"] in epoch_end]
    losses, accs = _series(train + val)
    for label, name in losses:
        line, = ax_loss.plot([r["step"] for r in train], [r["metrics"].get(name) for r in train],
                             lw=0.8, alpha=0.8, label=label)
        ax_loss.plot([epoch_end[r["epoch"]] for r in val_at], [r["metrics"].get(f"{name}_epoch") for r in val_at],
                     "o", color=line.get_color())
    for label, name in accs:
        if val:
            ax_acc.plot([r["epoch"] for r in val], [r["metrics"].get(f"{name}_epoch") for r in val], "o-", label=label)
        else:
            ax_acc.plot([r["step"] for r in train], [r["metrics"].get(name) for r in train], lw=0.8, label=label)
    ax_loss.set(title="loss (lines: training steps, dots: validation)", xlabel="step", ylabel="loss")
    ax_acc.set(title="validation accuracy" if val else "training accuracy", xlabel="epoch" if val else "step",
               ylabel="accuracy", ylim=(0, 1))
    if val:
        ax_acc.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def acceptance_per_position(per_position: list[float], mean_length: float, k: int, out: Path) -> Path:
    """Fraction of drafts whose token at position i was accepted (vLLM's per-position counters)."""
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=90)
    positions = list(range(1, len(per_position) + 1))
    bars = ax.bar(positions, per_position, color="#3b7dd8")
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set(title=f"acceptance per position (k={k}, mean length {mean_length:.3f})", xlabel="draft position",
           ylabel="accepted / drafts", ylim=(0, 1), xticks=positions)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def acceptance_history(rows: list[dict], out: Path) -> Path | None:
    """eaglet.report.history rows: mean acceptance length per kept draft, oldest first; the current one marked."""
    points = [(i, r) for i, r in enumerate(rows) if r["acceptance"] is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=90)
    ax.plot([i for i, _ in points], [r["acceptance"] for _, r in points], "o-", color="tab:blue")
    for i, r in points:
        if r["current"]:
            ax.plot([i], [r["acceptance"]], "*", markersize=16, color="tab:orange", label="current")
    ax.set_xticks([i for i, _ in points], [r["draft"][:6] for _, r in points], rotation=45, fontsize=7)
    ax.set_xlabel("draft (oldest first)")
    ax.set_ylabel("mean acceptance length")
    ax.grid(alpha=0.3)
    if any(r["current"] for _, r in points):
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def serving_payoff(evaluation: dict, out: Path) -> Path | None:
    """Left: output tokens/s at each concurrency, the verifier alone and the draft at each k; right: the speedup
    (with the draft / alone) per k, with the break-even line at 1."""
    alone = sorted(evaluation["verifier_alone"], key=lambda r: r["concurrency"])
    if not alone:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["concurrency"] for r in alone], [r["output_tokens_per_s"] for r in alone], "k-o", label="verifier alone")
    for k in evaluation["k"]:
        rows = sorted((r for r in evaluation["sweep"] if r["k"] == k), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        ax1.plot(xs, [r["output_tokens_per_s"] for r in rows], "-o", label=f"draft, k={k}")
        ax2.plot(xs, [r["speedup"] or 0 for r in rows], "-o", label=f"k={k}")
    ax2.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "speedup over the verifier alone")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    host = evaluation["machine"].get("gpus") or evaluation["machine"].get("cpu")
    fig.suptitle(f"vLLM serving benchmark on {host}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
