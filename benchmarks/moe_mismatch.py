"""Learner/sampler mismatch and router mismatch on tiny MoE models (random init, built in-process; no Hub).

    python benchmarks/moe_mismatch.py

For a tiny Qwen3-MoE and a tiny DeepSeek-V3-style model (4 experts, top-2, every dim a multiple of 128), runs 5 FP8
GRPO steps in each configuration and prints the mean `sampling/token_mult_prob_error` and `fp8/router_mismatch`.
"""

import argparse
import tempfile

import torch
import transformers

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Recipe
from trl_fp8.demo.make_model import build_tokenizer
from trl_fp8.demo.task import DEMO_GRPO_KWARGS, digit_count_reward, make_dataset
from trl_fp8.demo.tiny_moe import MOONLIGHT_RECIPE, tiny_deepseek_v3, tiny_qwen3_moe


CONFIGS = {"FP8 gen + BF16 train": dict(fp8_training=False), "FP8/FP8": dict(fp8_training=True)}


def main():
    # No options; a parser so that `--help` describes the run instead of starting it.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    tokenizer = build_tokenizer()
    print("| model | configuration | token_mult_prob_error | fp8/router_mismatch |\n| --- | --- | --- | --- |")
    models = (("Qwen3-MoE", tiny_qwen3_moe, FP8Recipe()), ("DeepSeek-V3", tiny_deepseek_v3, MOONLIGHT_RECIPE))
    for model_name, build, recipe in models:
        for label, flags in CONFIGS.items():
            with tempfile.TemporaryDirectory() as tmp:
                args = FP8GRPOConfig(
                    output_dir=tmp, learning_rate=1e-3, max_steps=5, per_device_train_batch_size=16,
                    **{**DEMO_GRPO_KWARGS, "max_completion_length": 8}, fp8_recipe=recipe.to_dict(), seed=0, **flags,
                )  # fmt: skip
                trainer = FP8GRPOTrainer(
                    model=build(tokenizer), reward_funcs=digit_count_reward, args=args,
                    train_dataset=make_dataset(80), processing_class=tokenizer,
                )  # fmt: skip
                trainer.remove_callback(transformers.PrinterCallback)
                trainer.train()
            logs = trainer.state.log_history
            mean = {
                k: sum(log[k] for log in logs if k in log) / sum(k in log for log in logs)
                for k in ("sampling/token_mult_prob_error", "fp8/router_mismatch")
            }
            error, routes = mean["sampling/token_mult_prob_error"], mean["fp8/router_mismatch"]
            print(f"| {model_name} | {label} | {error:.5f} | {routes:.4f} |")


if __name__ == "__main__":
    main()
