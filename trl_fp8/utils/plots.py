"""Training curves as PNG: reward and learner/sampler mismatch against the optimizer step."""

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


def series(log_history: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """`(steps, values)` of `key` in a `Trainer.state.log_history`."""
    points = [(log["step"], log[key]) for log in log_history if key in log and "step" in log]
    if not points:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*points, strict=True)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def plot_curves(
    runs: Mapping[str, Sequence[Sequence[dict]]],
    path: str | Path,
    keys: Sequence[str] = ("reward", "sampling/token_mult_prob_error"),
    title: str | None = None,
    smooth: int = 5,
    log_excess: Sequence[str] = ("sampling/token_mult_prob_error",),
) -> Path:
    """One panel per metric, one line per run (mean over its seeds, shaded by the seed spread); saves a PNG.

    Args:
        runs: Maps a run label to the `log_history` of each of its seeds.
        path: Where to write the PNG.
        keys: The metrics to plot, one panel each.
        title: Figure title.
        smooth: Window of the moving average drawn over each mean curve (1: none).
        log_excess: Metrics whose ideal value is 1 (`token_mult_prob_error`): drawn as `value - 1` on a log axis, so
            that 1.00002 and 1.016 are told apart as easily as 1.016 and 1.1.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for label, histories in runs.items():
            curves = [series(h, key) for h in histories]
            curves = [c for c in curves if len(c[0])]
            if not curves:
                continue
            n = min(len(c[0]) for c in curves)
            steps = curves[0][0][:n]
            values = np.stack([c[1][:n] for c in curves])
            if key in log_excess:
                values = np.maximum(values - 1.0, 1e-9)
            mean = values.mean(0)
            if smooth > 1 and n >= smooth:
                # A per-step reward over a few prompts is noisy: draw the raw mean faintly, its moving average bold.
                (line,) = ax.plot(steps, mean, alpha=0.25, linewidth=0.8)
                kernel = np.ones(smooth) / smooth
                ax.plot(steps[smooth - 1 :], np.convolve(mean, kernel, "valid"), color=line.get_color(), label=label)
            else:
                (line,) = ax.plot(steps, mean, label=label)
            if len(curves) > 1:
                ax.fill_between(steps, values.min(0), values.max(0), color=line.get_color(), alpha=0.15)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"{key} - 1 (log scale)" if key in log_excess else key)
        if key in log_excess:
            ax.set_yscale("log")
        ax.set_title(f"{key} - 1 (0: no mismatch)" if key in log_excess else key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
