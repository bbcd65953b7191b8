"""The training-curve figure (`trl_fp8.utils.plots`) on histories shaped like `Trainer.state.log_history`: long
enough for its moving average, and seeds of different lengths, which the trainer tests' 2-3 step runs never give; and
the GPU benchmark's figure of ratios against targets (`benchmarks/bench_report.py`)."""

import json
import sys
from pathlib import Path

import pytest

from trl_fp8.utils.plots import plot_curves, series


pytest.importorskip("matplotlib")


def history(steps: int, offset: float = 0.0) -> list[dict]:
    logs = [
        {"step": s, "reward": 0.1 * s + offset, "sampling/token_mult_prob_error": 1.0 + 1e-3 * s}
        for s in range(1, steps + 1)
    ]
    return logs + [{"train_runtime": 1.0}]  # the Trainer's closing entry has no step


def is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_series_reads_the_steps_that_log_the_key():
    steps, values = series(history(3), "reward")
    assert steps.tolist() == [1.0, 2.0, 3.0] and values.tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert series(history(3), "loss")[0].size == 0


def test_runs_longer_than_the_window_are_smoothed(tmp_path):
    assert is_png(plot_curves({"FP8/FP8": [history(12)]}, tmp_path / "curves.png", smooth=5))


def test_seeds_of_different_lengths_are_cut_to_the_shortest(tmp_path):
    """A run stopped early logs fewer steps than its sibling seeds."""
    runs = {"FP8/FP8": [history(9), history(7, offset=0.5)], "BF16/BF16": [history(8)]}
    assert is_png(plot_curves(runs, tmp_path / "curves.png", smooth=5))


def test_gpu_figure_draws_every_measured_ratio_against_its_target(tmp_path):
    """On the first H200 run's committed figures (`benchmarks/results/gpu/2026-11-30/gpu_bench.json`)."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    from bench_report import TARGETS, markdown, plot_panels, plot_targets

    results = json.loads((root / "benchmarks" / "results" / "gpu" / "2026-11-30" / "gpu_bench.json").read_text())
    gemm, linear, quantize, step = plot_panels(results)
    assert [p["target"] for p in (gemm, linear, quantize, step)] == [
        TARGETS["gemm"], TARGETS["linear"], TARGETS["quantize_share"], TARGETS["train_step"]
    ]  # fmt: skip
    for panel, key in ((gemm, "gemm"), (linear, "linear")):
        for backend in results["backends"]:
            assert list(panel["bars"][backend].values()) == [r[backend]["ratio"] for r in results[key]]
    assert sorted(quantize["bars"]["kernel"].values()) == sorted(
        v["share_of_copy"] for v in results["quantize"].values() if isinstance(v, dict)
    )
    assert step["bars"]["step"] == {n: results["train_step"][n]["ratio"] for n in results["backends"]}
    assert is_png(plot_targets(results, tmp_path / "gpu_targets.png"))
    # The report renders that run's JSON too, figures its script did not yet measure as nan.
    report = markdown(results)
    assert "| 8192 | 4096 | 6144 | 763 | 1031 (1.35x, nanx, 78) | 619 (0.81x, nanx, 78) |" in report
    assert "Targets: torch: gemm >= 1.6x MISSED" in report
    # Runs since record what the Triton GEMM's TMA configs win or lose in autotuning.
    results["gemm"][0]["triton"]["autotune_ms"] = {"128x128": {"plain": 0.812, "tma": 0.654}}
    assert "4096, 6144, 128x128 B scales: best plain tile 0.812 ms, best TMA warp-specialized 0.654 ms" in markdown(
        results
    )
    # The 2026-12-04 run autotuned without the TMA configs: the report says so rather than "nan ms".
    latest = json.loads((root / "benchmarks" / "results" / "gpu" / "gpu_bench.json").read_text())
    assert "6144, 128x128 B scales: best plain tile 0.492 ms (TMA configs off)" in markdown(latest)
    assert is_png(plot_targets(latest, tmp_path / "latest.png"))
