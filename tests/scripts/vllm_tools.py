"""Run by tests/test_tools.py (vLLM only), in a process of its own: two FP8 GRPO steps with tool calling (TRL's
`tools=`) sampled by colocated vLLM in block FP8, with the tool-calling policy of tests/test_tools.py saved to a
folder (vLLM loads its config and tokenizer from there); the checks' raw material in `<output_dir>/result.json`. On
vLLM's CPU build the block-FP8 kernels are stood in for as in tests/scripts/vllm_two_steps.py.

    python tests/scripts/vllm_tools.py OUTPUT_DIR
"""

import json
import os
import sys

import torch
from datasets import Dataset
from vllm_two_steps import _emulate_vllm_fp8_kernels_on_cpu  # this folder: the script's own sys.path[0]


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for test_tools
from test_tools import PROMPTS, multiply, tool_calling_policy  # noqa: E402

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer  # noqa: E402


def main(output_dir: str) -> None:
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _emulate_vllm_fp8_kernels_on_cpu()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model, tokenizer = tool_calling_policy()
    model_dir = os.path.join(output_dir, "policy")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return [float(i % 3) for i in range(len(completions))]  # distinct within each group of 4

    args = FP8GRPOConfig(
        output_dir, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, bf16=True,
        use_cpu=not on_gpu, per_device_train_batch_size=8, num_generations=4, max_completion_length=64, max_steps=2,
        max_tool_calling_iterations=1, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
        vllm_llm_kwargs={"enforce_eager": True},
    )  # fmt: skip
    trainer = FP8GRPOTrainer(
        model_dir,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        tools=[multiply],
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "tools/call_frequency" in log]
    result = {key: [log[key] for log in logs] for key in ("tools/call_frequency", "tools/failure_frequency")}
    result["errors"] = [log["sampling/token_mult_prob_error"] for log in logs]
    result["completions"] = seen
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
