"""The paper's mismatch table on the CPU demo: learner/sampler mismatch and reward for each precision configuration,
with and without token-level truncated importance sampling, over several seeds.

    python benchmarks/mismatch.py                      # full run: 40 steps x 3 seeds per configuration
    python benchmarks/mismatch.py --quick              # smoke run: 3 steps, one seed, into a temporary folder
    python benchmarks/mismatch.py --precisions "FP8/FP8 + FP8 KV cache" --kv_scale_percentile 100 \
        --kv_calibration_rows 128 --output_dir /tmp/kv_max_128   # one calibration variant of the KV-cache rows

Writes `<output_dir>/mismatch.md` (mean ± std over seeds), `<output_dir>/mismatch.json` (every run's log) and
`<output_dir>/mismatch.png` (reward and token_mult_prob_error vs step, one line per configuration, shaded by the seed
spread).
"""

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import PrinterCallback

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
from trl_fp8.demo.task import DEMO_GRPO_KWARGS, accuracy_reward, load_demo_model_and_tokenizer, make_dataset
from trl_fp8.utils.plots import plot_curves


PRECISIONS = {
    "BF16/BF16": dict(fp8_training=False, fp8_generation=False),
    "FP8 gen + BF16 train": dict(fp8_training=False, fp8_generation=True),
    "FP8/FP8": dict(fp8_training=True, fp8_generation=True),
    "FP8/FP8 + FP8 KV cache": dict(fp8_training=True, fp8_generation=True, fp8_kv_cache=True),
}
IS_MODES = {"no IS": dict(vllm_importance_sampling_correction=False), "token TIS C=2": {}}
METRICS = ("sampling/token_mult_prob_error", "sampling/gen_kl", "sampling/is_oob_ratio")
CALIBRATION = "fp8/kv_calibration_seconds"


def demo_trainer(fields: dict, seed: int, steps: int, batch: int, output_dir: str, learning_rate=2e-4, **kwargs):
    """The CPU demo's trainer with `fields` of FP8GRPOConfig (learning rate: the demo recipe's, recipes/demo_cpu.yaml),
    printing nothing: the table is the output, per-step dicts go to the JSON file."""
    model, tokenizer = load_demo_model_and_tokenizer()
    args = FP8GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        learning_rate=learning_rate,
        per_device_train_batch_size=batch,
        seed=seed,
        **DEMO_GRPO_KWARGS,
        **fields,
    )
    trainer = FP8GRPOTrainer(
        model=model,
        reward_funcs=accuracy_reward,
        args=args,
        train_dataset=make_dataset(steps * batch // 8, seed=seed),
        processing_class=tokenizer,
        **kwargs,
    )
    trainer.remove_callback(PrinterCallback)
    return trainer


def run(precision: dict, is_mode: dict, seed: int, steps: int, batch: int, output_dir: str) -> list[dict]:
    trainer = demo_trainer({**precision, **is_mode}, seed, steps, batch, output_dir)
    trainer.train()
    return [log for log in trainer.state.log_history if "reward" in log]


def mean_std(values: list[float], fmt: str) -> str:
    if not values:
        return "–"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{format(statistics.fmean(values), fmt)} ± {format(std, fmt)}"


def summarize(results: dict[str, list[list[dict]]], tail: int) -> str:
    """Markdown table: per run, the metrics averaged over its steps, then mean ± std over seeds."""

    def per_seed(histories, key, last=None):
        out = []
        for h in histories:
            values = [log[key] for log in h if key in log]
            values = values[-last:] if last else values
            if values:
                out.append(statistics.fmean(values))
        return out

    rows = [
        "| configuration | token_mult_prob_error | gen_kl | is_oob_ratio | final reward (last "
        f"{tail} steps) | reward gap to BF16/BF16 | KV calibration, share of step time |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, histories in results.items():
        precision, _, is_label = label.partition(", ")
        base = results.get(f"BF16/BF16, {is_label}")
        reward = per_seed(histories, "reward", tail)
        gap = "–"
        if base is not None:
            base_reward = per_seed(base, "reward", tail)
            gap = f"{statistics.fmean(reward) - statistics.fmean(base_reward):+.3f}"
        shares = [
            sum(log.get(CALIBRATION, 0.0) for log in h) / sum(log["step_time"] for log in h)
            for h in histories
            if any(CALIBRATION in log for log in h)
        ]
        error, kl, oob = (per_seed(histories, key) for key in METRICS)
        calibration = mean_std([100 * x for x in shares], ".1f") + " %" if shares else "–"
        rows.append(
            f"| {label} | {mean_std(error, '.5f')} | {mean_std(kl, '.2e')} | {mean_std(oob, '.4f')} | "
            f"{mean_std(reward, '.3f')} | {gap} | {calibration} |"
        )
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--output_dir", default=None, help="default: benchmarks/results (with --quick: a temporary folder)"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=128, help="completions per step (16 prompts x 8)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="3 steps, one seed: a smoke run for CI")
    parser.add_argument("--replot", action="store_true", help="only redraw mismatch.png from mismatch.json")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument(
        "--kv_scale_percentile", type=float, default=None, help="FP8GRPOConfig.fp8_kv_scale_percentile (KV rows)"
    )
    parser.add_argument(
        "--kv_calibration_rows", type=int, default=None, help="FP8GRPOConfig.fp8_kv_calibration_rows (KV rows)"
    )
    args = parser.parse_args()
    if args.output_dir is None:  # a smoke run must not overwrite the committed figures
        args.output_dir = (
            Path(tempfile.gettempdir()) / "trl_fp8_mismatch_quick" if args.quick else "benchmarks/results"
        )
    out = Path(args.output_dir)
    if args.replot:
        results = json.loads((out / "mismatch.json").read_text())["runs"]
        plot_curves(results, out / "mismatch.png", title="CPU demo: reward and learner/sampler mismatch")
        return
    if args.quick:
        args.steps, args.seeds, args.batch = 3, [0], 32
    torch.set_num_threads(1)  # the demo model is tiny: one thread is fastest and leaves the other core free
    transformers.logging.set_verbosity_error()
    logging.getLogger("trl_fp8").setLevel(logging.ERROR)

    out.mkdir(parents=True, exist_ok=True)
    jobs = [(p, i, s) for p in args.precisions for i in IS_MODES for s in args.seeds]
    kv_fields = {
        field: value
        for field, value in (
            ("fp8_kv_scale_percentile", args.kv_scale_percentile),
            ("fp8_kv_calibration_rows", args.kv_calibration_rows),
        )
        if value is not None
    }
    results: dict[str, list[list[dict]]] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for precision, is_label, seed in tqdm(jobs, desc="mismatch runs"):
            fields = {**PRECISIONS[precision], **(kv_fields if PRECISIONS[precision].get("fp8_kv_cache") else {})}
            history = run(fields, IS_MODES[is_label], seed, args.steps, args.batch, tmp)
            results.setdefault(f"{precision}, {is_label}", []).append(history)
    minutes = (time.perf_counter() - start) / 60

    tail = min(10, args.steps)
    table = summarize(results, tail)
    write_outputs(out, "mismatch", table, "", args, results, minutes, "CPU demo: reward and learner/sampler mismatch")


def write_outputs(out: Path, stem: str, table: str, setup: str, args, results: dict, minutes: float, title: str):
    """`<stem>.md` (the table and how it was made), `<stem>.json` (every run's log) and `<stem>.png` in `out`."""
    (out / f"{stem}.md").write_text(
        f"{table}\n\n{setup}{args.steps} GRPO steps of {args.batch} completions per run, seeds {args.seeds}, "
        f"{minutes:.1f} min in all; mismatch metrics are averaged over each run's steps, then mean ± std over seeds.\n"
    )
    (out / f"{stem}.json").write_text(json.dumps({"steps": args.steps, "seeds": args.seeds, "runs": results}))
    plot_curves(results, out / f"{stem}.png", title=title)
    print(table)
    print(f"wrote {out / stem}.md, .json, .png ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
