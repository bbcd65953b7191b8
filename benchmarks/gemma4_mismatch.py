"""Why Gemma 4 has the largest learner/sampler mismatch of the family sweep (`benchmarks/families.py`).

Gemma 4 scores attention as q·k unscaled (`scaling = 1.0`), leaving the scale to its trained q/k norms. In a tiny
random model those norms start at 1, so the scores have a standard deviation of about sqrt(head_dim) and the softmax
is nearly one-hot, which turns a rounding difference in q or k into a large log-prob change. This runs the `gemma4`
family with its particular features switched off one at a time, and with the scores scaled by 1/sqrt(head_dim) as in
Gemma 3, in BF16/BF16 and end-to-end FP8 (the reference engine, as the family sweep):

    python benchmarks/gemma4_mismatch.py --bf16 --output_dir /tmp/gemma4    # about 1 minute on 2 cores
    python benchmarks/gemma4_mismatch.py --output_dir /tmp/gemma4_fp32

Writes `<output_dir>/gemma4_mismatch.md` (the table) and `gemma4_mismatch.json` (every run's mismatch per step).
"""

import argparse
import json
import logging
import statistics
import tempfile
from contextlib import contextmanager
from pathlib import Path

import families as sweep  # benchmarks/families.py
import torch
import transformers
from tqdm.auto import tqdm

from trl_fp8.demo.families import available


FEATURES_OFF = dict(
    num_kv_shared_layers=0, attention_k_eq_v=False, hidden_size_per_layer_input=0, use_double_wide_mlp=False
)
VARIANTS = {  # name: (the table's label, config overrides, scores scaled)
    "sweep": ("as in the sweep", {}, False),
    "no_kv_shared": ("no KV-shared layer", dict(num_kv_shared_layers=0), False),
    "values_not_keys": ("values are not keys", dict(attention_k_eq_v=False), False),
    "no_per_layer_inputs": ("no per-layer inputs", dict(hidden_size_per_layer_input=0), False),
    "none": ("none of the three", FEATURES_OFF, False),
    "sweep_scaled": ("as in the sweep, scores scaled", {}, True),
    "none_scaled": ("none of the three, scores scaled", FEATURES_OFF, True),
}
RUN_CONFIGS = ("BF16/BF16", "FP8/FP8")


@contextmanager
def scores_scaled(enabled: bool):
    """Gemma 4's attention, learner's and sampler's alike, scaled by 1/sqrt(head_dim) as Gemma 3's is."""
    from transformers.models.gemma4 import modeling_gemma4

    cls = modeling_gemma4.Gemma4TextAttention
    init = cls.__init__

    def scaled_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.scaling = self.head_dim**-0.5

    if enabled:
        cls.__init__ = scaled_init
    try:
        yield
    finally:
        cls.__init__ = init


@contextmanager
def gemma4_overrides(overrides: dict):
    """The family sweep's `tiny`, which its `run` builds the model with, making `gemma4` with `overrides`."""
    tiny = sweep.tiny
    sweep.tiny = lambda family, seed=0, **more: tiny(family, seed, **{**overrides, **more})
    try:
        yield
    finally:
        sweep.tiny = tiny


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--bf16", action="store_true", help="TRL's default bf16=True (the learner under bf16 autocast)"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    if not available("gemma4"):
        raise SystemExit(f"transformers {transformers.__version__} has no Gemma 4")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    logging.getLogger("trl_fp8").setLevel(logging.ERROR)

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, config in tqdm([(v, c) for v in args.variants for c in RUN_CONFIGS], desc="gemma4 runs"):
            _, overrides, scaled = VARIANTS[variant]
            with gemma4_overrides(overrides), scores_scaled(scaled):
                errors, _ = sweep.run("gemma4", sweep.CONFIGS[config], args.steps, tmp, bf16=args.bf16)
            results.setdefault(variant, {})[config] = errors

    precision = "bf16=True" if args.bf16 else "fp32"
    lines = ["| gemma4 | " + " | ".join(RUN_CONFIGS) + " |", "|" + " --- |" * (1 + len(RUN_CONFIGS))]
    for variant, runs in results.items():
        cells = [f"{statistics.median(runs[c]):.5f} (max {max(runs[c]):.4g})" for c in RUN_CONFIGS]
        lines.append(f"| {VARIANTS[variant][0]} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    footer = f"{args.steps} GRPO steps per run ({precision}, the reference engine); median over steps (largest step)."
    (out / "gemma4_mismatch.md").write_text(f"{text}\n\n{footer}\n")
    (out / "gemma4_mismatch.json").write_text(json.dumps({"precision": precision, "runs": results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
