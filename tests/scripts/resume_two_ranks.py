"""Run by tests/test_distributed.py under `accelerate launch` on two ranks, with the accelerate config of a layout
(ZeRO-2, ZeRO-3, FSDP2): three FP8 GRPO steps straight through; then the same schedule checkpointed at step 2 and
interrupted there; then a fresh trainer resumed from that checkpoint (`train(resume_from_checkpoint=...)`, as a user
restarting a preempted job does). Each rank writes to `<output_dir>/rank{r}.pt` the whole parameters of the three
trainers, the steps the resumed one ran and the logs of both finished ones."""

import os
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import tiny_grpo_args, tiny_policy  # noqa: E402
from fsdp_on_cpu import allow_fsdp_on_cpu  # noqa: E402

from trl_fp8 import FP8GRPOTrainer  # noqa: E402
from trl_fp8.demo.make_model import build_tokenizer  # noqa: E402
from trl_fp8.demo.task import digit_count_reward, make_dataset  # noqa: E402


class Steps(TrainerCallback):
    """Counts the optimizer steps this trainer ran itself; with `stop_at`, stops training after that global step."""

    def __init__(self, stop_at: int | None = None):
        self.ran, self.stop_at = 0, stop_at

    def on_step_end(self, args, state, control, **kwargs):
        self.ran += 1
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True


def trainer_for(output_dir: Path, tokenizer, **overrides) -> FP8GRPOTrainer:
    args = tiny_grpo_args(output_dir, learning_rate=0.05, max_steps=3, fp8_kv_cache=True, **overrides)
    return FP8GRPOTrainer(
        model=tiny_policy(tokenizer),
        reward_funcs=digit_count_reward,
        args=args,
        train_dataset=make_dataset(32),
        processing_class=tokenizer,
    )


def whole_parameters(trainer: FP8GRPOTrainer) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank: ZeRO-3 gathers them, FSDP2 all-gathers each DTensor."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
    }


def main(output_dir: Path):
    if os.environ.get("ACCELERATE_USE_FSDP", "false") == "true":
        allow_fsdp_on_cpu()
    tokenizer = build_tokenizer()
    straight = trainer_for(output_dir / "straight", tokenizer)
    straight.train()
    interrupted = trainer_for(output_dir / "resumed", tokenizer, save_strategy="steps", save_steps=2)
    interrupted.add_callback(Steps(stop_at=2))
    interrupted.train()
    resumed, steps = trainer_for(output_dir / "resumed", tokenizer), Steps()
    resumed.add_callback(steps)
    resumed.train(resume_from_checkpoint=str(output_dir / "resumed" / "checkpoint-2"))
    torch.save(
        {
            "straight": whole_parameters(straight),
            "interrupted": whole_parameters(interrupted),
            "resumed": whole_parameters(resumed),
            "resumed_steps": steps.ran,
            "straight_logs": straight.state.log_history,
            "resumed_logs": resumed.state.log_history,
            "layout": "fsdp2"
            if straight.is_fsdp_enabled
            else f"zero{straight.accelerator.state.deepspeed_plugin.zero_stage}",
        },
        output_dir / f"rank{PartialState().process_index}.pt",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
