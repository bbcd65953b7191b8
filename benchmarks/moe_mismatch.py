"""Learner/sampler mismatch and router mismatch on tiny MoE models (random init, built in-process; no Hub).

    python benchmarks/moe_mismatch.py

For a tiny Qwen3-MoE and a tiny DeepSeek-V3-style model (4 experts, top-2, every dim a multiple of 128), runs 5 FP8
GRPO steps in each configuration and prints the mean `sampling/token_mult_prob_error` and `fp8/router_mismatch`.
"""

import sys
import tempfile
from pathlib import Path

import torch
import transformers


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import digit_reward, tiny_grpo_args  # noqa: E402
from test_moe import MOONLIGHT, deepseek_v3, qwen3_moe  # noqa: E402

from trl_fp8 import FP8GRPOTrainer, FP8Recipe  # noqa: E402
from trl_fp8.demo.make_model import build_tokenizer  # noqa: E402
from trl_fp8.demo.task import make_dataset  # noqa: E402


CONFIGS = {"FP8 gen + BF16 train": dict(fp8_training=False), "FP8/FP8": dict(fp8_training=True)}


def main():
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    tokenizer = build_tokenizer()
    print("| model | configuration | token_mult_prob_error | fp8/router_mismatch |\n| --- | --- | --- | --- |")
    for model_name, build, recipe in (("Qwen3-MoE", qwen3_moe, FP8Recipe()), ("DeepSeek-V3", deepseek_v3, MOONLIGHT)):
        for label, flags in CONFIGS.items():
            with tempfile.TemporaryDirectory() as tmp:
                args = tiny_grpo_args(
                    tmp, learning_rate=1e-3, max_steps=5, per_device_train_batch_size=16, num_generations=8,
                    max_completion_length=8, fp8_recipe=recipe.to_dict(), disable_tqdm=True, **flags,
                )  # fmt: skip
                trainer = FP8GRPOTrainer(
                    model=build(tokenizer), reward_funcs=digit_reward, args=args,
                    train_dataset=make_dataset(80), processing_class=tokenizer,
                )  # fmt: skip
                trainer.remove_callback(transformers.PrinterCallback)
                trainer.train()
            logs = trainer.state.log_history
            mean = {
                k: sum(log[k] for log in logs if k in log) / sum(k in log for log in logs)
                for k in ("sampling/token_mult_prob_error", "fp8/router_mismatch")
            }
            print(
                f"| {model_name} | {label} | {mean['sampling/token_mult_prob_error']:.5f} | {mean['fp8/router_mismatch']:.4f} |"
            )


if __name__ == "__main__":
    main()
