"""FP8 + LoRA on the CPU demo: learner/sampler mismatch and reward of LoRA in BF16, in FP8 as trl-fp8 runs it (each
adapted layer computes with the quantized merged weight the sampler receives), and, as an ablation, in FP8 the way
PEFT's forward would run it over an FP8 base (`Q(W)·x + s·B·A·x`, while the sampler holds `Q(W + s·B·A)`).

    python benchmarks/lora_mismatch.py            # 40 steps x 3 seeds per configuration, about 6 minutes on 2 cores
    python benchmarks/lora_mismatch.py --quick    # smoke run: 3 steps, one seed, into a temporary folder

Writes `<output_dir>/lora_mismatch.md` (mean ± std over seeds), `lora_mismatch.json` (every run's log) and
`lora_mismatch.png`. The ablation is not an option of the library: this script makes it by re-classing the trainer's
FP8 LoRA layers back to PEFT's and quantizing their merged weight for the sampler, which is what a trainer that
merged adapters only at sync time would do.
"""

import argparse
import logging
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from mismatch import demo_trainer, summarize, write_outputs
from peft import LoraConfig
from peft.tuners.lora import Linear as LoraLinear
from tqdm.auto import tqdm

import trl_fp8.quant.export as export
from trl_fp8.quant import FP8Linear, quantize_blockwise
from trl_fp8.quant.adapters import effective_weight
from trl_fp8.quant.lora import FP8LoraLinear


CONFIGS = {
    "LoRA BF16/BF16": dict(fp8_training=False, fp8_generation=False),
    "LoRA FP8/FP8 merged weight (trl-fp8)": dict(fp8_training=True, fp8_generation=True),
    "LoRA FP8/FP8 additive (ablation)": dict(fp8_training=True, fp8_generation=True, additive=True),
}
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)


@contextmanager
def additive_lora_sync():
    """The sampler gets each PEFT layer's merged weight quantized at sync time, whatever the learner computed."""
    original = export.fp8_weight

    def merged_then_quantized(layer, name):
        if type(layer) is LoraLinear and isinstance(layer.get_base_layer(), FP8Linear):
            return quantize_blockwise(effective_weight(layer), (128, 128))
        return original(layer, name)

    export.fp8_weight = merged_then_quantized
    try:
        yield
    finally:
        export.fp8_weight = original


def run(config: dict, seed: int, steps: int, batch: int, lr: float, output_dir: str) -> list[dict]:
    config = dict(config)
    additive = config.pop("additive", False)
    trainer = demo_trainer(config, seed, steps, batch, output_dir, lr, peft_config=LoraConfig(**LORA))
    if additive:  # PEFT's own forward: the FP8 base's output plus the adapter's, in high precision
        for module in trainer.model.modules():
            if isinstance(module, FP8LoraLinear):
                module.__class__ = LoraLinear
        with additive_lora_sync():
            trainer.train()
    else:
        trainer.train()
    return [log for log in trainer.state.log_history if "reward" in log]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=None, help="default: benchmarks/results (--quick: a temporary one)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=128, help="completions per step (16 prompts x 8)")
    parser.add_argument("--learning_rate", type=float, default=1e-3, help="LoRA's (5x the demo's full-model 2e-4)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="3 steps, one seed: a smoke run")
    args = parser.parse_args()
    if args.output_dir is None:
        args.output_dir = Path(tempfile.gettempdir()) / "trl_fp8_lora_quick" if args.quick else "benchmarks/results"
    if args.quick:
        args.steps, args.seeds, args.batch = 3, [0], 32
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    logging.getLogger("trl_fp8").setLevel(logging.ERROR)

    results: dict[str, list[list[dict]]] = {}
    start = time.perf_counter()
    jobs = [(label, seed) for label in CONFIGS for seed in args.seeds]
    with tempfile.TemporaryDirectory() as tmp:
        for label, seed in tqdm(jobs, desc="LoRA runs"):
            history = run(CONFIGS[label], seed, args.steps, args.batch, args.learning_rate, tmp)
            results.setdefault(f"{label}, token TIS C=2", []).append(history)
    minutes = (time.perf_counter() - start) / 60

    # `summarize` measures reward gaps against "BF16/BF16, <IS mode>": here, LoRA in BF16.
    keyed = {label.removeprefix("LoRA "): runs for label, runs in results.items()}
    lines = summarize(keyed, min(10, args.steps)).split("\n")
    table = "\n".join(lines[:2] + [line.replace("| ", "| LoRA ", 1) for line in lines[2:]])
    setup = f"LoRA r={LORA['r']}, alpha={LORA['lora_alpha']} on every linear, learning rate {args.learning_rate}; "
    title = "CPU demo, LoRA: reward and learner/sampler mismatch"
    write_outputs(out, "lora_mismatch", table, setup, args, results, minutes, title)


if __name__ == "__main__":
    main()
