"""`gpu_bench.py`'s report: the markdown tables of every section, the targets of issue #5, Amdahl's bound on the
training step, and one figure of every FP8/BF16 ratio against its target. Pure functions of the results dict that
`gpu_bench.py` also writes as JSON; run as a script to draw the figure from that JSON on another machine (the GPU
machine may lack matplotlib):

    python benchmarks/bench_report.py benchmarks/results/gpu     # reads gpu_bench.json, writes gpu_targets.png
"""

import argparse
import json
import math
import sys
from pathlib import Path


# As a script from anywhere: its section helpers import trl_fp8 (a checkout's, where it is not installed).
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from host_overhead import host_markdown  # noqa: E402
from step_profile import profile_markdown  # noqa: E402


TARGETS = {"gemm": 1.6, "linear": 1.3, "quantize_share": 0.70, "train_step": 1.15}
# (f): least SQNR against the oracle on the same FP8 operands. Same codes, so only accumulation order and the bf16
# output's rounding differ (about 56 dB for a bf16 rounding alone); one wrong 128x128 tile of an 8192 x 4096 output
# reads about 33 dB.
MATCH_DB = {"gemm": 45, "linear": 40, "moe": 40}
# (c) is judged on the quantizers training runs: X with Xᵀ in one pass (fprop and wgrad; dY likewise), W with Wᵀ.
TRAINING_QUANTIZERS = ("fused 1x128 + transposed (triton, one pass)", "weight 128x128 + transposed (triton, one pass)")
# (d)'s sections: the target is the 1B model's; the 8B layers show what the recipe's model size gives.
STEP_MODELS = {
    "train_step": "Llama-3.2-1B shape",
    "train_step_1seq": "Llama-3.2-1B shape",
    "train_step_8b": "two Llama-3.1-8B layers, vocabulary 1024 (not a target)",
}


def markdown(results) -> str:
    names = results["backends"]
    lines = [f"Device: {results['device']}; torch {results['torch']}; triton {results.get('triton')}; "
             f"FP8 backends: {', '.join(names) or 'none'}", ""]  # fmt: skip
    for section, error in results.get("errors", {}).items():
        lines += [f"**{section} failed**: `{error.splitlines()[-1] if error else ''}`", ""]
    for section, why in results.get("skipped", {}).items():
        lines += [f"**{section} skipped**: {why}", ""]
    if "running" in results:
        lines += [f"**{results['running']} was running when these figures were written** (cut short there?)", ""]
    if "gemm" in results:
        gemm_names = [n for n in names if n in results["gemm"][0]]  # TE swaps modules: no bare GEMM row
        head = " | ".join(f"{n} TFLOP/s (ratio, ratio with 1x128 B, dB vs emulated with each)" for n in gemm_names)
        lines += [
            "(a) GEMM, bf16 out",
            "",
            f"| M | K | N | BF16 TFLOP/s | {head} |",
            "|---" * (4 + len(gemm_names)) + "|",
        ]
        for r in results["gemm"]:
            cells = " | ".join(
                _failed(r[n])
                or f"{r[n]['tflops']:.0f} ({r[n]['ratio']:.2f}x, {r[n].get('ratio_1x128_b', math.nan):.2f}x, "
                f"{r[n]['sqnr_vs_emulated_db']:.0f}/{r[n].get('sqnr_1x128_vs_emulated_db', math.nan):.0f})"
                for n in gemm_names
            )
            lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {r['bf16_tflops']:.0f} | {cells} |")
        for r in results["gemm"]:
            for scales, t in r.get("triton", {}).get("autotune_ms", {}).items():
                tma = f", best TMA warp-specialized {t['tma']:.3f} ms" if "tma" in t else " (TMA configs off)"
                lines.append(f"\nTriton autotuning at M, K, N = {r['M']}, {r['K']}, {r['N']}, {scales} B scales: best "
                             f"plain tile {t.get('plain', math.nan):.3f} ms{tma}")  # fmt: skip
        tuned = results["gemm"][-1].get("triton_autotuned", {})
        lines += [f"\nAutotuned triton GEMM, {k}: {v}" for k, v in tuned.items()]
    if "linear" in results:
        head = " | ".join(f"{n} ms (ratio, weight cached; dgrad/wgrad dB)" for n in names)
        lines += ["", "(b) FP8Linear forward+backward, all quantization included", "",
                  f"| M | K | N | BF16 ms | {head} |", "|---" * (4 + len(names)) + "|"]  # fmt: skip
        for r in results["linear"]:
            cells = " | ".join(
                _failed(r[n])
                or f"{r[n]['ms']:.2f} ({r[n]['ratio']:.2f}x, {r[n].get('ratio_weight_cached', math.nan):.2f}x; "
                f"{r[n]['dgrad_sqnr_vs_emulated_db']:.0f}/"
                f"{r[n]['wgrad_sqnr_vs_emulated_db']:.0f})"
                for n in names
            )
            lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {r['bf16_ms']:.2f} | {cells} |")
    if "quantize" in results:
        q = results["quantize"]
        lines += ["", f"(c) quantization bandwidth (copy: {q['copy_bandwidth_gbs']:.0f} GB/s)", "",
                  "| kernel | GB/s | share of copy |", "|---|---|---|"]  # fmt: skip
        lines += [
            f"| {k} | {v['bandwidth_gbs']:.0f} | {v['share_of_copy']:.0%} |"
            for k, v in q.items()
            if isinstance(v, dict) and "bandwidth_gbs" in v
        ]
        for kernel in ("act", "weight"):
            tuned = q.get(f"{kernel}_kernel_autotuned", {})
            lines += [f"\nAutotuned {kernel} quantizer, {k}: {v}" for k, v in tuned.items()]
    for key, model in STEP_MODELS.items():
        if key not in results:
            continue
        t = results[key]
        lines += ["", f"(d, e) training step, {model}, {t.get('shape', '')}", "",
                  "| precision | tokens/s | step ms | ratio | peak GiB |", "|---|---|---|---|---|"]  # fmt: skip
        for label, v in t.items():
            if label == "shape":
                continue
            if _failed(v):
                lines.append(f"| {label} | {_failed(v)} | | | |")
                continue
            lines.append(f"| {label} | {v['tokens_per_s']:.0f} | {v['step_ms']:.1f} | {v.get('ratio', 1.0):.2f} | "
                         f"{v['peak_memory_gib']:.2f} |")  # fmt: skip
    if "moe" in results:
        lines += [
            "",
            "(g) MoE layer (Qwen3-30B-A3B shape) forward+backward",
            "",
            "| path | ms | notes |",
            "|---|---|---|",
        ]
        for k, v in results["moe"].items():
            notes = ", ".join(
                f"{a} {b:.2f}" if isinstance(b, float) else f"{a} {b}"
                for a, b in v.items()
                if a not in ("ms", "autotuned")
            )
            lines.append(f"| {k} | {v.get('ms', float('nan')):.2f} | {notes} |")
        for k, v in results["moe"].items():
            lines += [f"\nAutotuned {k}, {key}: {cfg}" for key, cfg in v.get("autotuned", {}).items()]
    if "profile" in results:
        lines += profile_markdown(results["profile"])
        bound = step_bound(results)
        if bound:
            lines += ["", bound]
    if "profile_1seq" in results:
        lines += profile_markdown(results["profile_1seq"])
    if "host" in results:
        lines += host_markdown(results["host"])
    if not_judged(results):
        lines += ["", f"Targets: not judged ({not_judged(results)})."]
    elif "targets_met" in results:
        lines += [
            "",
            "Targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in results["targets_met"].items()),
        ]
    return "\n".join(lines) + "\n"


def _failed(figures: dict) -> str | None:
    return f"failed: `{figures['error']}`" if "error" in figures else None


def failed_measurements(results) -> list[str]:
    """The backends and labels whose measurement failed inside sections that ran (`section: name`)."""
    failed = [f"{key}: {n}" for key in ("gemm", "linear") for r in results.get(key) or [] for n in results["backends"]
              if n in r and "error" in r[n]]  # fmt: skip
    failed += [f"{key}: {label}" for key in STEP_MODELS for label, v in (results.get(key) or {}).items()
               if isinstance(v, dict) and "error" in v]  # fmt: skip
    return sorted(set(failed))


def not_judged(results) -> str | None:
    """Why this run's ratios say nothing about the targets, or None where they do (full shapes on a GPU)."""
    if results.get("smoke"):
        return "a --smoke run: tiny shapes check the script, not the hardware"
    if results.get("device") == "cpu":
        return "no GPU: the oracle stands in for the FP8 GEMMs, against CPU BF16"
    return None


def step_bound(results) -> str | None:
    """Amdahl's bound on (d): BF16's GEMM share of the step (lm_head's included, so an over-estimate) sped up by
    (a)'s best FP8 GEMM ratio, quantization free, everything else unchanged."""
    bf16 = results["profile"].get("bf16", {})
    gemm_rows = results.get("gemm") or []
    ratios = [r[n]["ratio"] for r in gemm_rows for n in results["backends"] if n in r]
    if "categories" not in bf16 or not ratios:
        return None
    share, best = bf16["categories"]["gemm"]["share"], max(ratios)
    return (
        f"Bound on (d): GEMMs are {share:.0%} of the BF16 step; at (a)'s best FP8 ratio ({best:.2f}x) with free "
        f"quantization the step could reach at most {1 / (1 - share + share / best):.2f}x."
    )


def targets(results) -> dict[str, bool]:
    met = {}
    if not_judged(results):
        return met
    db = MATCH_DB
    for name in results["backends"]:
        # A failed measurement misses its target (ratio 0, SQNR -inf).
        if results.get("gemm") and name in results["gemm"][0]:
            rows = [r[name] for r in results["gemm"]]
            met[f"{name}: gemm >= 1.6x"] = min(r.get("ratio", 0.0) for r in rows) >= TARGETS["gemm"]
            met[f"{name}: gemm matches emulated (>= {db['gemm']} dB)"] = all(
                min(r.get("sqnr_vs_emulated_db", -math.inf), r.get("sqnr_1x128_vs_emulated_db", math.inf))
                >= db["gemm"]
                for r in rows
            )
        if results.get("linear") and name in results["linear"][0]:
            rows = [r[name] for r in results["linear"]]
            met[f"{name}: linear >= 1.3x"] = min(r.get("ratio", 0.0) for r in rows) >= TARGETS["linear"]
            met[f"{name}: linear dgrad/wgrad match emulated (>= {db['linear']} dB)"] = all(
                min(r.get("dgrad_sqnr_vs_emulated_db", -math.inf), r.get("wgrad_sqnr_vs_emulated_db", -math.inf))
                >= db["linear"]
                for r in rows
            )
        if "train_step" in results and name in results["train_step"]:
            ratio = results["train_step"][name].get("ratio", 0.0)
            met[f"{name}: train step >= 1.15x"] = ratio >= TARGETS["train_step"]
    quantize = results.get("quantize") or {}
    if kernels := [k for k in TRAINING_QUANTIZERS if k in quantize]:  # (runs before 2026-12-05 lack W with Wᵀ)
        shares = [quantize[k]["share_of_copy"] for k in kernels]
        met["triton quantize (training's kernels) >= 70% of copy"] = min(shares) >= TARGETS["quantize_share"]
    grouped = (results.get("moe") or {}).get("fp8 grouped", {})
    if "dx_sqnr_vs_per_expert_db" in grouped:
        met[f"moe grouped matches per-expert (>= {db['moe']} dB)"] = grouped["dx_sqnr_vs_per_expert_db"] >= db["moe"]
    return met


def _gemm_label(r) -> str:
    m = f"{r['M'] // 1024}k" if r["M"] % 1024 == 0 else str(r["M"])
    return f"{m} x {r['K']}\n-> {r['N']}"


def plot_panels(results) -> list[dict]:
    """What `plot_targets` draws: per panel a title, its target, and `{group: {x label: value}}`, one bar group per
    backend in (a) and (b); values are ratios to BF16, or in (c) shares of copy bandwidth."""
    names = list(results["backends"])
    panels = []
    for key, title, target in (("gemm", "(a) block-FP8 GEMM", "gemm"), ("linear", "(b) FP8Linear fwd+bwd", "linear")):
        rows = results.get(key) or []
        bars = {n: {_gemm_label(r): r[n]["ratio"] for r in rows if n in r} for n in names}
        panels.append(dict(title=f"{title}, ratio to BF16", target=TARGETS[target], bars=bars, ylabel="x BF16"))
    q = results.get("quantize") or {}
    shares = {k: v["share_of_copy"] for k, v in q.items() if isinstance(v, dict) and "share_of_copy" in v}
    panels.append(
        dict(
            title="(c) quantization, share of copy bandwidth",
            target=TARGETS["quantize_share"],
            bars={"kernel": shares},
            ylabel="share of copy",
        )
    )
    steps = {}
    for key, tag in (("train_step", ""), ("train_step_1seq", ", 1 seq"), ("train_step_8b", ", 8B layers")):
        for label, v in (results.get(key) or {}).items():
            if isinstance(v, dict) and "ratio" in v:
                steps.setdefault("step", {})[f"{label}{tag}"] = v["ratio"]
    shape = (results.get("train_step") or {}).get("shape", "")
    title = f"(d) 1B training step {shape}".strip() + (" (and 8B layers)" if "train_step_8b" in results else "")
    panels.append(dict(title=title, target=TARGETS["train_step"], bars=steps,
                       ylabel="x BF16 tokens/s"))  # fmt: skip
    return panels


def plot_targets(results, path: str | Path) -> Path:
    """Every FP8/BF16 ratio of (a)-(d) as bars, with BF16 (1.0) and issue #5's target drawn across; saves a PNG."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = plot_panels(results)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for ax, panel in zip(axes.flat, panels, strict=True):
        groups = [g for g, values in panel["bars"].items() if values]
        labels = list(dict.fromkeys(x for g in groups for x in panel["bars"][g]))
        width = 0.8 / max(1, len(groups))
        top = panel["target"]
        for i, group in enumerate(groups):
            placed = [(j, panel["bars"][group][x]) for j, x in enumerate(labels) if x in panel["bars"][group]]
            xs = [j + (i - (len(groups) - 1) / 2) * width for j, _ in placed]
            bars = ax.bar(xs, [y for _, y in placed], width, label=group if len(groups) > 1 else None)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
            top = max(top, *(y for _, y in placed))
        if "share" not in panel["ylabel"]:
            ax.axhline(1.0, color="grey", linewidth=1, label="BF16")
        ax.axhline(panel["target"], color="red", linestyle="--", linewidth=1, label=f"target {panel['target']:g}")
        wrapped = [
            "\n".join(textwrap.fill(line, 16, break_long_words=False) for line in x.splitlines()) for x in labels
        ]
        ax.set_xticks(range(len(labels)), wrapped, fontsize=7)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel(panel["ylabel"])
        ax.set_title(panel["title"], fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", ncol=4)
    why = not_judged(results)
    fig.suptitle(
        f"FP8 vs BF16 on {results['device']} (torch {results['torch']})" + (f"\nnot judged: {why}" if why else "")
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a gpu_bench output folder (holding gpu_bench.json)")
    folder = Path(parser.parse_args().folder)
    results = json.loads((folder / "gpu_bench.json").read_text())
    print(f"wrote {plot_targets(results, folder / 'gpu_targets.png')}")


if __name__ == "__main__":
    main()
