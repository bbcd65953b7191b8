"""The recipe's central claim, measured on the shipped demo model with a fixed seed: a sampler that holds the
learner's own FP8 weights (end-to-end FP8) disagrees with the learner less than an FP8 sampler behind a
high-precision learner ("FP8 generation only"); a high-precision sampler behind a high-precision learner is the
floor, which end-to-end FP8 reaches up to fp32 rounding noise."""

from conftest import tiny_grpo_args

from trl_fp8 import FP8GRPOTrainer
from trl_fp8.demo.task import accuracy_reward, load_demo_model_and_tokenizer, make_dataset


CONFIGS = {
    "bf16/bf16": dict(fp8_training=False, fp8_generation=False),
    "fp8-gen-only": dict(fp8_training=False, fp8_generation=True),
    "fp8/fp8": dict(fp8_training=True, fp8_generation=True),
}


def mean_mismatch(tmp_path, name, **fp8_flags):
    model, tokenizer = load_demo_model_and_tokenizer()
    args = tiny_grpo_args(
        tmp_path / name,
        learning_rate=1e-4,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=4,
        max_steps=3,
        **fp8_flags,
    )
    trainer = FP8GRPOTrainer(
        model=model,
        reward_funcs=accuracy_reward,
        args=args,
        train_dataset=make_dataset(64),
        processing_class=tokenizer,
    )
    trainer.train()
    values = [
        log["sampling/token_mult_prob_error"]
        for log in trainer.state.log_history
        if "sampling/token_mult_prob_error" in log
    ]
    assert len(values) == 3
    return sum(values) / len(values)


def test_end_to_end_fp8_mismatch_is_below_fp8_generation_only(tmp_path):
    errors = {name: mean_mismatch(tmp_path, name, **flags) for name, flags in CONFIGS.items()}
    print("token_mult_prob_error:", {k: round(v, 6) for k, v in errors.items()})
    assert errors["fp8/fp8"] < errors["fp8-gen-only"]
    # BF16/BF16 is the floor, and end-to-end FP8 sits on it up to fp32 rounding noise (the learner's full forward and
    # the sampler's cached decode sum in another order): 1.0000004 vs 1.0000006 on one CPU, the other way on another.
    assert errors["bf16/bf16"] <= errors["fp8/fp8"] + 1e-5
    assert errors["fp8-gen-only"] > 1.0
