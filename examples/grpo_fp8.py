# /// script
# dependencies = [
#     "trl-fp8",
#     "matplotlib",
# ]
# ///
"""
GRPO with FP8 in both generation and training: `FP8GRPOTrainer`, a drop-in `GRPOTrainer`.

CPU demo (no GPU, no Hub; about a minute on 2 cores), from the repository root:

    accelerate launch examples/grpo_fp8.py --config recipes/demo_cpu.yaml

It trains the shipped tiny Llama (`trl-fp8-demo`) on two-digit addition with an exact-match reward, logs reward and
learner/sampler mismatch every step, and writes `<output_dir>/training_curves.png`.

Real runs use the same script with a GPU recipe (`recipes/`), e.g. NeMo RL's Llama-3.1-8B math recipe on one node
of 8 Hopper GPUs (the command line overrides its model, dataset or rewards, e.g. `--model_name_or_path Qwen/Qwen3-8B`):

    accelerate launch --config_file examples/accelerate_configs/zero2_8gpu.yaml examples/grpo_fp8.py \
        --config recipes/llama31_8b_math_fp8.yaml

FP8 + LoRA takes TRL's `ModelConfig` flags, with dropout off (the adapters train on their merged FP8 weight):

    accelerate launch examples/grpo_fp8.py --config recipes/demo_cpu.yaml \
        --use_peft --lora_r 16 --lora_alpha 32 --lora_target_modules all-linear --lora_dropout 0

On several processes, through an accelerate config: DeepSpeed ZeRO-2 (the recipes' layout) or ZeRO-3, e.g. on two CPU
processes (`pip install "trl-fp8[deepspeed]"`):

    accelerate launch --config_file examples/accelerate_configs/zero3_cpu.yaml examples/grpo_fp8.py \
        --config recipes/demo_cpu.yaml --per_device_train_batch_size 64

or FSDP2, on GPUs (accelerate runs FSDP configs on accelerators only):

    accelerate launch --config_file examples/accelerate_configs/fsdp2_8gpu.yaml examples/grpo_fp8.py \
        --config <your recipe>.yaml

The script arguments are TRL's `trl grpo` script's (`reward_funcs` by TRL's names or dotted paths,
`reward_model_name_or_path`, `dataset_test_split`, ...), so a config written for it runs here in FP8; resume a job
with `--resume_from_checkpoint <output_dir>/checkpoint-N`. Any `FP8GRPOConfig` / `GRPOConfig` field can be set in the
YAML or overridden on the command line. An override
replaces the YAML's value whole: `--fp8_recipe '{"pow2_scales": true}'` is that recipe, not the YAML's recipe with
pow2 scales (repeat the YAML's other recipe fields in it).
"""

import importlib
import logging
import os
import sys
from dataclasses import dataclass, field

from datasets import load_dataset
from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config
from trl.scripts.grpo import GRPOScriptArguments

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer


logger = logging.getLogger(__name__)
DEMO = "trl-fp8-demo"


@dataclass
class ScriptArguments(GRPOScriptArguments):
    """TRL's GRPO script arguments (`trl grpo`: the same flags and YAML keys), with the CPU demo as the default task
    and two more fields."""

    dataset_name: str | None = field(
        default=DEMO,
        metadata={"help": f"Hub or local dataset with a 'prompt' column, or '{DEMO}' for the in-code addition task."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions: the names TRL's grpo script knows (accuracy_reward, ...) or dotted "
                  f"import paths (module.function). Default: the demo's exact match on '{DEMO}', else none."},
    )  # fmt: skip
    num_train_samples: int = field(default=2048, metadata={"help": f"Rows of the '{DEMO}' dataset."})
    plot: bool = field(default=True, metadata={"help": "Write training_curves.png (reward, mismatch) at the end."})


def import_reward(path: str):
    """A reward function from its name in TRL's grpo script (`trl.rewards`, with that script's settings) or its
    dotted import path."""
    import trl.rewards

    registry = {
        "accuracy_reward": trl.rewards.accuracy_reward,
        "reasoning_accuracy_reward": trl.rewards.reasoning_accuracy_reward,
        "think_format_reward": trl.rewards.think_format_reward,
        "get_soft_overlong_punishment": trl.rewards.get_soft_overlong_punishment(
            max_completion_len=1280, soft_punish_cache=256
        ),
    }
    if path in registry:
        return registry[path]
    module, _, name = path.rpartition(".")
    if not module:
        raise ValueError(
            f"reward_funcs: {path!r} is neither one of {list(registry)} nor a dotted path 'module.function'"
        )
    if os.getcwd() not in sys.path:  # as TRL's script: a module beside where the job was launched
        sys.path.insert(0, os.getcwd())
    return getattr(importlib.import_module(module), name)


def main(script_args: ScriptArguments, training_args: FP8GRPOConfig, model_args: ModelConfig):
    model_name = model_args.model_name_or_path or DEMO
    if model_name == DEMO:
        from trl_fp8.demo.task import DEMO_MODEL_DIR

        model_name = str(DEMO_MODEL_DIR)
    # As TRL's script: the model flags, then what `model_init_kwargs` sets over them.
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    evaluate = training_args.eval_strategy != "no"
    if script_args.dataset_name == DEMO:
        from trl_fp8.demo.task import make_dataset

        dataset = {script_args.dataset_train_split: make_dataset(script_args.num_train_samples, training_args.seed)}
        if evaluate:  # another draw of problems (another seed)
            dataset[script_args.dataset_test_split] = make_dataset(256, training_args.seed + 1)
    else:
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    rewards = [script_args.reward_model_name_or_path] if script_args.reward_model_name_or_path else []
    reward_funcs = script_args.reward_funcs
    if reward_funcs is None and script_args.dataset_name == DEMO:
        reward_funcs = ["trl_fp8.demo.task.accuracy_reward"]
    rewards += [import_reward(p) for p in reward_funcs or []]

    trainer = FP8GRPOTrainer(
        model=model_name,
        reward_funcs=rewards,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if evaluate else None,
        processing_class=AutoTokenizer.from_pretrained(
            model_name,
            padding_side="left",
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,  # Moonlight's tokenizer is custom code
        ),
        quantization_config=get_quantization_config(model_args),  # refused with FP8 on, naming the field
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)  # as TRL's scripts
    if trainer.is_fsdp_enabled:  # one checkpoint, gathered from FSDP's shards, that loads anywhere
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(training_args.output_dir)

    if trainer.accelerator.is_main_process:
        history = trainer.state.log_history
        rewards = [log["reward"] for log in history if "reward" in log]
        if len(rewards) >= 20:
            first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
            print(f"reward: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
        errors = [log["sampling/token_mult_prob_error"] for log in history if "sampling/token_mult_prob_error" in log]
        if errors:
            print(f"token_mult_prob_error: mean {sum(errors) / len(errors):.5f}, max {max(errors):.5f}")
        if script_args.plot:
            try:
                from trl_fp8.utils.plots import plot_curves

                path = plot_curves(
                    {"FP8 GRPO": [history]},
                    f"{training_args.output_dir}/training_curves.png",
                    title=f"{model_args.model_name_or_path or DEMO}: reward and learner/sampler mismatch",
                )
                print(f"wrote {path}")
            except ImportError:
                logger.warning("matplotlib is not installed: no plot (pip install matplotlib)")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if hasattr(trainer, "end"):  # transformers >= 5.18: finishes the trackers, ends the process group
        trainer.end()


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, FP8GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    main(script_args, training_args, model_args)
