"""Run by tests/test_vllm_engine.py (GPU + vLLM only), one configuration per process since vLLM sets up one engine
per process: two FP8 GRPO steps with colocated vLLM in block FP8, then the checks' raw material in
`<output_dir>/result.json`.

    python tests/scripts/vllm_two_steps.py OUTPUT_DIR [--kv_cache] [--lora]

`TRL_FP8_VLLM_MODEL` may name a local model folder (e.g. Qwen2.5-0.5B-Instruct); the default is the tiny demo model.
"""

import json
import os
import sys

import torch
from peft import LoraConfig

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, iter_fp8_state
from trl_fp8.demo.task import DEMO_MODEL_DIR, digit_count_reward, make_dataset
from trl_fp8.quant.adapters import unwrap_peft


def main(output_dir: str, kv_cache: bool, lora: bool) -> None:
    args = FP8GRPOConfig(
        output_dir, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, bf16=True,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=16, max_steps=2, report_to="none",
        logging_steps=1, save_strategy="no", fp8_kv_cache=kv_cache, vllm_llm_kwargs={"enforce_eager": True},
    )  # fmt: skip
    model = os.environ.get("TRL_FP8_VLLM_MODEL", str(DEMO_MODEL_DIR))
    peft_config = LoraConfig(r=16, target_modules="all-linear", lora_dropout=0.0) if lora else None
    trainer = FP8GRPOTrainer(
        model, reward_funcs=digit_count_reward, args=args, train_dataset=make_dataset(64), peft_config=peft_config
    )
    trainer.train()
    key = "sampling/token_mult_prob_error"
    result = {"errors": [log[key] for log in trainer.state.log_history if key in log]}

    engine = trainer.vllm_generation
    engine.sync_weights()
    export = dict(iter_fp8_state(unwrap_peft(trainer.accelerator.unwrap_model(trainer.model))))
    served = engine.llm.apply_model(
        lambda m: {n: p.detach().cpu() for n, p in m.named_parameters() if ".layers.0." in n}
    )[0]
    prefix = "model.layers.0.self_attn."
    result["bit_identical"] = {}
    for suffix, view in (("weight", torch.uint8), ("weight_scale_inv", torch.float32)):
        expected = torch.cat([export[f"{prefix}{p}.{suffix}"].cpu() for p in ("q_proj", "k_proj", "v_proj")])
        result["bit_identical"][suffix] = torch.equal(
            served[f"{prefix}qkv_proj.{suffix}"].view(view), expected.view(view)
        )
    if kv_cache:
        result["kv_scales_served"] = engine.llm.apply_model(
            lambda m: [[float(layer.self_attn.attn._k_scale), float(layer.self_attn.attn._v_scale),
                        float(layer.self_attn.attn._q_scale)] for layer in m.model.layers]
        )[0]  # fmt: skip
        result["kv_scales_sent"] = engine._kv_scale_invs.tolist()

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(50):
        engine.sync_weights()
    torch.cuda.synchronize()
    result["memory_growth_bytes"] = torch.cuda.memory_allocated() - before
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], "--kv_cache" in sys.argv[2:], "--lora" in sys.argv[2:])
