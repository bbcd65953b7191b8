"""Run by tests/test_vllm_engine.py (vLLM only), one family per process: a tiny random model of a
`trl_fp8.demo.families` family, saved with the demo tokenizer, trained two FP8 GRPO steps (with a reference model:
beta > 0) with colocated vLLM in block FP8; the checks' raw material in `<output_dir>/result.json`. On vLLM's CPU build
the block-FP8 GEMM is trl-fp8's `emulated` one, as in tests/scripts/vllm_two_steps.py.

    python tests/scripts/vllm_family.py FAMILY OUTPUT_DIR
"""

import json
import os
import sys

import torch
from transformers import AutoTokenizer
from vllm_two_steps import _emulate_vllm_fp8_gemm_on_cpu, _storages  # this folder: the script's own sys.path[0]

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
from trl_fp8.demo.families import tiny, varied_reward
from trl_fp8.demo.task import DEMO_MODEL_DIR, make_dataset


def _params(engine) -> dict[str, torch.Tensor]:
    return engine.llm.apply_model(lambda m: {n: p.detach().clone().cpu() for n, p in m.named_parameters()})[0]


def main(family: str, output_dir: str) -> None:
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _emulate_vllm_fp8_gemm_on_cpu()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model_dir = os.path.join(output_dir, family)
    tiny(family).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(DEMO_MODEL_DIR).save_pretrained(model_dir)
    args = FP8GRPOConfig(
        output_dir, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, bf16=True,
        use_cpu=not on_gpu, per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=2,
        report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, beta=0.04,
        vllm_llm_kwargs={"enforce_eager": True},
    )  # fmt: skip
    trainer = FP8GRPOTrainer(model_dir, reward_funcs=varied_reward, args=args, train_dataset=make_dataset(64))
    engine = trainer.vllm_generation
    dummy = _params(engine)  # `load_format="dummy"`: random values until the first refit
    trainer.train()
    synced = _params(engine)
    storages = _storages(engine)
    for _ in range(3):
        engine.sync_weights()
    key = "sampling/token_mult_prob_error"
    result = {
        "errors": [log[key] for log in trainer.state.log_history if key in log],
        "params": len(synced),
        "not_written": sorted(n for n, t in synced.items() if torch.equal(t, dummy[n])),
        "in_place": _storages(engine) == storages,
    }
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
