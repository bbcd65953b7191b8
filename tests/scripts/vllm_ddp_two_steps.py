"""Run by tests/test_vllm_ranks.py under `accelerate launch --num_processes 2` (vLLM only): two FP8 GRPO steps with
DDP (or DeepSpeed ZeRO-3, or FSDP2, as the accelerate config says), the FP8 KV cache and one colocated vLLM engine per
rank, as on a node of GPUs; then each rank writes what its engine serves (weights, K/V/Q scales), its learner's
parameters and its export to `<output_dir>/rank{r}.pt`. With `--tp`, the two ranks' engines are one engine in tensor
parallelism (`vllm_tensor_parallel_size=2`), on a tiny Qwen3 whose every shard is whole 128x128 blocks. On vLLM's CPU
build the block-FP8 kernels are stood in for as in tests/scripts/vllm_two_steps.py. `--no_kv_cache` leaves the FP8 KV
cache out (vLLM's CPU build runs one only on x86 with AVX-512 or AMX).

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/vllm_ddp_two_steps.py OUTPUT_DIR [--tp] [--no_kv_cache]
"""

import os
import sys
from contextlib import nullcontext

import torch
from accelerate import PartialState
from fsdp_on_cpu import allow_fsdp_on_cpu
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer
from vllm_two_steps import _emulate_vllm_fp8_kernels_on_cpu

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, iter_fp8_state
from trl_fp8.demo.families import tiny
from trl_fp8.demo.task import DEMO_MODEL_DIR, digit_count_reward, make_dataset
from trl_fp8.generation.gather import learner_gather


def gathered(model, zero3: bool):
    """The whole parameters on every rank (ZeRO-3 shards them)."""
    if not zero3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def main(output_dir: str, tp: bool, kv_cache: bool) -> None:
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _emulate_vllm_fp8_kernels_on_cpu()
        if os.environ.get("ACCELERATE_USE_FSDP", "false") == "true":
            allow_fsdp_on_cpu()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = str(DEMO_MODEL_DIR)
    if tp:  # k_proj and v_proj 256 rows: 128 per rank (the demo model's 128 would split into half blocks)
        model = os.path.join(
            output_dir, f"qwen3-{os.environ['RANK']}"
        )  # a copy per rank: no rank reads a half-written one
        tiny("qwen3", head_dim=128).save_pretrained(model)
        AutoTokenizer.from_pretrained(DEMO_MODEL_DIR).save_pretrained(model)
    args = FP8GRPOConfig(
        output_dir, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, bf16=True,
        use_cpu=not on_gpu, per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=2,
        learning_rate=0.05, fp8_kv_cache=kv_cache, report_to="none", logging_steps=1, save_strategy="no",
        disable_tqdm=True, vllm_llm_kwargs={"enforce_eager": True}, vllm_tensor_parallel_size=2 if tp else 1,
    )  # fmt: skip
    trainer = FP8GRPOTrainer(model, reward_funcs=digit_count_reward, args=args, train_dataset=make_dataset(64))
    trainer.train()
    engine = trainer.vllm_generation
    engine.sync_weights()  # the refit after the last optimizer step (every rank: the scales are reduced over ranks)
    names = ("_k_scale_float", "_v_scale_float", "_q_scale_float")
    policy = trainer.accelerator.unwrap_model(trainer.model)
    zero3 = trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    with gathered(policy, zero3):
        learner = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).cpu().clone()
            for n, p in policy.named_parameters()
        }
    # What a forward quantizes (under FSDP2 with bf16, the unit's bf16 copy of the fp32 master weight): q_proj's.
    q_proj, seen = policy.get_submodule("model.layers.0.self_attn.q_proj"), {}
    hook = q_proj.register_forward_pre_hook(lambda m, args: seen.setdefault("q", m.quantized_weight()) and None)
    with torch.no_grad():
        trainer.model(input_ids=torch.tensor([[1, 2, 3, 4]], device=trainer.accelerator.device))
    hook.remove()
    with learner_gather(trainer.accelerator, trainer.model) as gather:
        export = {n: t.cpu().clone() for n, t in iter_fp8_state(policy, gather=gather)}
    torch.save(
        {
            "world_size": trainer.accelerator.num_processes,
            "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else 0,
            "fsdp": trainer.is_fsdp_enabled,
            "forward_q_proj": [t.cpu().clone() for t in seen["q"]],
            "log_history": trainer.state.log_history,
            "learner": learner,
            "export": export,
            "served": engine.llm.apply_model(lambda m: {n: p.detach().cpu() for n, p in m.named_parameters()})[0],
            "kv_scales_served": engine.llm.apply_model(
                lambda m: [[float(getattr(layer.self_attn.attn, n)) for n in names] for layer in m.model.layers]
            )[0]
            if kv_cache
            else None,
            "kv_scales_sent": engine._kv_scale_invs.tolist() if kv_cache else None,
        },
        os.path.join(output_dir, f"rank{PartialState().process_index}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], "--tp" in sys.argv[2:], "--no_kv_cache" not in sys.argv[2:])
