"""Learner/sampler mismatch across transformers model families: a tiny random model of each family of
`trl_fp8.demo.families` trains with FP8GRPOTrainer in the paper's three configurations (BF16/BF16, FP8 generation
only, end-to-end FP8), and the table reports what runs in FP8 and each configuration's `token_mult_prob_error`:
the median over the run's steps, and its largest step (FP8 generation alone has rare steps where a token the
learner finds unlikely dominates the mean).

    python benchmarks/families.py            # 10 steps per run, every family (about 3 minutes on 2 cores)
    python benchmarks/families.py --quick    # 2 steps, three families, into a temporary folder
    python benchmarks/families.py --bf16 --families qwen3 mistral --output_dir /tmp/families_bf16  # TRL's bf16=True

Writes `<output_dir>/families.md` (the table), `families.json` (every run's mismatch per step) and `families.png`
(`token_mult_prob_error - 1` per family and configuration, log scale).
"""

import argparse
import json
import logging
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import PrinterCallback

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Recipe, iter_fp8_state
from trl_fp8.demo.families import FAMILIES, available, tiny, varied_reward
from trl_fp8.demo.make_model import build_tokenizer
from trl_fp8.demo.task import make_dataset
from trl_fp8.quant.convert import select_fp8_experts, select_fp8_linears


CONFIGS = {
    "BF16/BF16": dict(fp8_training=False, fp8_generation=False),
    "FP8 generation only": dict(fp8_training=False, fp8_generation=True),
    "FP8/FP8": dict(fp8_training=True, fp8_generation=True),
}
KEY = "sampling/token_mult_prob_error"


def run(family: str, config: dict, steps: int, output_dir: str, bf16: bool = False) -> tuple[list[float], float]:
    """One run: the mismatch per step, and the share of the model's parameters the sampler receives in FP8."""
    tokenizer = build_tokenizer()
    args = FP8GRPOConfig(
        output_dir=output_dir, learning_rate=0.01, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, max_steps=steps, logging_steps=1, report_to="none", use_cpu=True, bf16=bf16,
        save_strategy="no", gradient_checkpointing=False, disable_tqdm=True, seed=0, **config,
    )  # fmt: skip
    trainer = FP8GRPOTrainer(
        model=tiny(family),
        reward_funcs=varied_reward,
        args=args,
        train_dataset=make_dataset(64),
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    errors = [log[KEY] for log in trainer.state.log_history if KEY in log]
    learner = trainer.vllm_generation.learner()
    total = sum(p.numel() for p in learner.parameters())
    fp8 = sum(t.numel() for _, t in iter_fp8_state(learner) if t.dtype == torch.float8_e4m3fn)
    return errors, fp8 / total


def kept_in_high_precision(family: str) -> list[str]:
    """What the start warning names, once per kind of module: "linear_attn.in_proj_b (32x256, ...)"."""
    model, recipe = tiny(family), FP8Recipe()
    kept = select_fp8_linears(model, recipe)[1] + select_fp8_experts(model, recipe)[1]
    return list(dict.fromkeys(re.sub(r"^(?:.*\.)?layers\.\d+\.", "", item) for item in kept))


def table(results: dict) -> str:
    header = "| family | params in FP8 | kept in high precision | " + " | ".join(CONFIGS) + " |"
    lines = [header, "|" + " --- |" * (3 + len(CONFIGS))]
    for family, runs in results.items():
        kept = "; ".join(runs["kept"]) or "–"
        cells = [f"{statistics.median(runs[c]['errors']):.5f} (max {max(runs[c]['errors']):.4g})" for c in CONFIGS]
        lines.append(f"| {family} | {runs['fp8_share']:.0%} | {kept} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path, precision: str = "fp32") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(results)
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(families)), 4))
    width = 0.8 / len(CONFIGS)
    for i, config in enumerate(CONFIGS):
        excess = [max(statistics.median(results[f][config]["errors"]) - 1, 1e-7) for f in families]
        ax.bar([x + i * width for x in range(len(families))], excess, width, label=config)
    ax.set_xticks([x + width for x in range(len(families))], families, rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("token_mult_prob_error - 1 (log scale)")
    ax.set_title(f"Learner/sampler mismatch per model family (tiny random models, {precision}, median over steps)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=None, help="default: benchmarks/results (--quick: a temporary folder)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--quick", action="store_true", help="2 steps, three families: a smoke run for CI")
    parser.add_argument(
        "--bf16", action="store_true", help="TRL's default bf16=True (the learner under bf16 autocast)"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.families = 2, ["qwen3", "qwen3_5", "gpt_oss"]
    out = Path(
        args.output_dir or (Path(tempfile.gettempdir()) / "trl_fp8_families" if args.quick else "benchmarks/results")
    )
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    logging.getLogger("trl_fp8").setLevel(logging.ERROR)

    families = [f for f in args.families if available(f)]
    results: dict = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for family, config in tqdm([(f, c) for f in families for c in CONFIGS], desc="family runs"):
            errors, share = run(family, CONFIGS[config], args.steps, tmp, bf16=args.bf16)
            entry = results.setdefault(family, {"kept": kept_in_high_precision(family)})
            entry[config] = dict(errors=errors)
            if config == "FP8/FP8":
                entry["fp8_share"] = share
    minutes = (time.perf_counter() - start) / 60
    text, precision = table(results), "bf16=True" if args.bf16 else "fp32"
    (out / "families.md").write_text(
        f"{text}\n\n{args.steps} GRPO steps of 8 completions per run (seed 0, lr 0.01, {precision}, the reference "
        f"engine), {minutes:.1f} min in all; `token_mult_prob_error`: the median over each run's steps (its largest "
        "step).\n"
    )
    (out / "families.json").write_text(json.dumps({"steps": args.steps, "runs": results}))
    plot(results, out / "families.png", precision)
    print(text)
    print(f"wrote {out / 'families'}.md, .json, .png ({minutes:.1f} min)")


if __name__ == "__main__":
    main()
