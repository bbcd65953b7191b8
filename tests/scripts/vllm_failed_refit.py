"""Run by tests/test_vllm_end_to_end.py (vLLM only): a refit that fails inside vLLM's reload (the stream raises after
layer 0 and the first weight of layer 1, as an out-of-memory while vLLM rebuilds a layer would), then the next sync,
with an image's encoder output cached on both sides beforehand (which that sync must clear).
The checks' raw material in `<output_dir>/result.json`. On vLLM's CPU build the block-FP8 kernels are stood in for as
in tests/scripts/vllm_two_steps.py.

    python tests/scripts/vllm_failed_refit.py OUTPUT_DIR
"""

import json
import os
import sys

import torch
from vllm_two_steps import _emulate_vllm_fp8_kernels_on_cpu, _greedy  # this folder: the script's own sys.path[0]

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
from trl_fp8.demo.task import DEMO_MODEL_DIR, digit_count_reward, make_dataset
from trl_fp8.generation.vllm_refit import refit


FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
FAIL_AFTER = "model.layers.1.self_attn.q_proj.weight"


def _served(engine) -> dict[str, torch.Tensor]:
    return engine.llm.apply_model(lambda m: {n: p.detach().cpu().clone() for n, p in m.named_parameters()})[0]


def _holds(served: dict[str, torch.Tensor], pairs: list[tuple[str, torch.Tensor]], layer: int) -> bool:
    """Whether vLLM's layer `layer` holds the FP8 weights and scales of `pairs` (q/k/v and gate/up fused as vLLM
    holds them), bit for bit: all 8 of them."""
    stream, compared = dict(pairs), 0
    prefix = f"model.layers.{layer}."
    for name, served_tensor in served.items():
        if not name.startswith(prefix) or not name.endswith(("weight", "weight_scale_inv")) or "norm" in name:
            continue
        module, _, leaf = name[len(prefix) :].rpartition(".")
        parent, _, own = module.rpartition(".")
        parts = [f"{parent}.{p}" for p in FUSED[module]] if module in FUSED else [module]
        sent = torch.cat([stream[f"{prefix}{p}.{leaf}"].cpu() for p in parts])
        as_bits = torch.uint8 if sent.dtype == torch.float8_e4m3fn else sent.dtype
        if served_tensor.device.type == "meta" or not torch.equal(served_tensor.view(as_bits), sent.view(as_bits)):
            return False
        compared += 1
    return compared == 8


class _FailingStream(list):
    """The stream, raising once `FAIL_AFTER` has gone by, as vLLM would on an out-of-memory mid-reload."""

    def __iter__(self):
        for name, tensor in list.__iter__(self):
            yield name, tensor
            if name == FAIL_AFTER:
                raise RuntimeError("simulated out-of-memory while vLLM rebuilds a layer")


def _plant_encoder_output(engine, mm_hash: str):
    """An image's encoder output (its vision embeddings) cached by an earlier generation, as vLLM 0.31 records it on
    both sides: the scheduler's `encoder_cache_manager` (cached, referenced by no running request) and the worker's
    `encoder_cache`. The demo model has no vision tower, so the entry is planted; returns both holders."""
    core = engine.llm.llm_engine.engine_core.engine_core  # external_launcher: the engine core runs in this process
    manager, runner = core.scheduler.encoder_cache_manager, core.model_executor.driver_worker.worker.model_runner
    manager.cached[mm_hash], manager.freeable[mm_hash] = set(), 4
    manager.num_freeable_slots += 4
    runner.encoder_cache[mm_hash] = torch.zeros(4, 256)
    return manager, runner


def main(output_dir: str) -> None:
    _emulate_vllm_fp8_kernels_on_cpu()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = FP8GRPOConfig(
        output_dir, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, bf16=True, use_cpu=True,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, vllm_llm_kwargs={"enforce_eager": True},
    )  # fmt: skip
    trainer = FP8GRPOTrainer(
        str(DEMO_MODEL_DIR), reward_funcs=digit_count_reward, args=args, train_dataset=make_dataset(16)
    )
    trainer.train()
    engine, tokenizer = trainer.vllm_generation, trainer.processing_class
    engine.sync_weights()
    before = engine.state_stream()
    with torch.no_grad():  # the learner moves on, as after an optimizer step
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    after = engine.state_stream()
    result = {}
    try:
        refit(engine.llm, _FailingStream(after))
    except RuntimeError as error:
        result["error"] = str(error)
        result["notes"] = getattr(error, "__notes__", [])
    served = _served(engine)
    result["meta"] = sorted(n for n, t in served.items() if t.device.type == "meta")
    result["layer0_new"] = _holds(served, after, 0)
    result["layer1_old"] = _holds(served, before, 1)
    result["layer1_new"] = _holds(served, after, 1)
    result["generates"] = len(_greedy(engine.llm, tokenizer)) > 0
    scheduler_side, worker_side = _plant_encoder_output(engine, "image-seen-before")
    engine.sync_weights()  # the next sync, as TRL's next generation makes it
    served = _served(engine)
    result["resynced"] = _holds(served, after, 0) and _holds(served, after, 1)
    result["encoder_cache_after_refit"] = {"scheduler": "image-seen-before" in scheduler_side.cached,
                                           "worker": "image-seen-before" in worker_side.encoder_cache}  # fmt: skip
    with open(os.path.join(output_dir, "result.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
