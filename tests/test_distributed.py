"""Real two-process runs on CPU through `accelerate launch`: DDP (gloo), DeepSpeed ZeRO-2 as the recipes run, and
ZeRO-3."""

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import launch_two_processes, needs_fsdp2, tiny_policy
from safetensors.torch import load_file

from trl_fp8.demo.make_model import build_tokenizer


SCRIPT = Path(__file__).parent / "scripts" / "ddp_two_steps.py"


def run_two_processes(tmp_path, *flags) -> list[dict]:
    return launch_two_processes(SCRIPT, tmp_path, *flags)


def test_two_process_ddp_ends_with_identical_weights(tmp_path):
    ranks = run_two_processes(tmp_path)
    assert ranks[0]["world_size"] == ranks[1]["world_size"] == 2
    assert [rank["conversion_device"] for rank in ranks] == [None, None]  # the Trainer moved the model
    steps = [log for log in ranks[0]["log_history"] if "loss" in log]
    assert len(steps) == 2 and all("sampling/token_mult_prob_error" in log for log in steps)
    # The mismatch metrics are token means over both ranks' rollouts (summed across ranks, then divided), so every
    # rank logs the same figures.
    other = [log for log in ranks[1]["log_history"] if "loss" in log]
    for key in ("sampling/token_mult_prob_error", "sampling/gen_kl", "sampling/is_oob_ratio"):
        assert [log[key] for log in steps] == [log[key] for log in other], key
    # Each rank calibrates on its own rollouts; the scales are reduced (max) so that every sampler holds the same.
    kv_scales = ranks[0]["kv_scales"]
    assert len(kv_scales) == 3 * 2 and all(s.item() > 0 for s in kv_scales.values())  # Q, K, V of 2 layers
    for name, s0 in kv_scales.items():
        assert torch.equal(s0, ranks[1]["kv_scales"][name]), f"{name} differs between the ranks"
    # The agreed scales are the largest any rank measured: no rank's values saturate.
    local = [ranks[r]["kv_local"] for r in (0, 1)]
    assert not torch.equal(local[0], local[1])
    assert torch.equal(ranks[0]["kv_agreed"], torch.maximum(*local))
    for name, p0 in ranks[0]["params"].items():
        assert torch.equal(p0, ranks[1]["params"][name]), f"{name} differs between the ranks"
    initial = tiny_policy(build_tokenizer())
    moved = [n for n, p in initial.named_parameters() if not torch.equal(p.detach(), ranks[0]["params"][n])]
    assert len(moved) == len(ranks[0]["params"]), "some parameters did not train"


ZERO2_CPU = Path(__file__).parents[1] / "examples" / "accelerate_configs" / "zero2_cpu.yaml"
ZERO3_CPU = ZERO2_CPU.with_name("zero3_cpu.yaml")
FSDP2_CPU = SCRIPT.with_name("fsdp2_cpu.yaml")
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed (pip install deepspeed)"
)


@needs_deepspeed
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_process_deepspeed_zero2_trains_fp8_as_the_recipes_do(tmp_path, lora):
    """The recipes' layout (examples/accelerate_configs/zero2_8gpu.yaml) on two CPU processes: ZeRO-2 shards the
    optimizer states and writes the updated weights back into whole parameters without moving their version
    counters; every FP8 layer still quantizes the weights it holds, the ranks end identical, and each sampler holds
    its learner's FP8 weights (with LoRA, the merged ones) bit for bit."""
    ranks = launch_two_processes(SCRIPT, tmp_path, *["--lora"] * lora, config_file=ZERO2_CPU)
    assert [rank["zero_stage"] for rank in ranks] == [2, 2] and ranks[0]["world_size"] == 2
    # The device DeepSpeed trains on (the CPU here): TE's linears would be built there, not where the model waits.
    assert [rank["conversion_device"] for rank in ranks] == ["cpu", "cpu"]
    for rank in ranks:
        assert len(rank["fresh_fp8_weights"]) == 14 and all(rank["fresh_fp8_weights"]), rank["fresh_fp8_weights"]
    for name, p0 in ranks[0]["params"].items():
        assert torch.equal(p0, ranks[1]["params"][name]), f"{name} differs between the ranks"
    if lora:
        assert sum("lora_" in n for n in ranks[0]["params"]) == 28  # A and B of 14 layers
    else:
        initial = tiny_policy(build_tokenizer())
        moved = [n for n, p in initial.named_parameters() if not torch.equal(p.detach(), ranks[0]["params"][n])]
        assert len(moved) == len(ranks[0]["params"]), "some parameters did not train"
    for rank in ranks:
        assert rank["learner_fp8"] and any(n.endswith("weight_scale_inv") for n in rank["learner_fp8"])
        for name, t in rank["learner_fp8"].items():
            assert torch.equal(rank["sampler_fp8"][name].view(torch.uint8), t.view(torch.uint8)), name
    errors = [log["sampling/token_mult_prob_error"] for log in ranks[0]["log_history"] if "loss" in log]
    assert len(errors) == 2 and max(errors) < 1.1, errors  # the FP8 KV cache is on: its rounding, not the weights


@needs_deepspeed
@pytest.mark.xdist_group("ddp_run")  # with FSDP2's: the DDP baselines they share
@pytest.mark.parametrize("model", ["dense", "lora", "moe"])
def test_two_process_deepspeed_zero3_computes_what_ddp_does(tmp_path, model, ddp_run):
    """ZeRO-3 (TRL's zero3.yaml settings: the policy and the reference model built sharded, by zero.Init) shards the
    parameters too. Every FP8 linear quantizes the weight DeepSpeed gathers for it (each FP8 LoRA layer, which reads
    its base layer's weight, gathered as one: a DeepSpeed leaf; sibling linears run alone), the reference model is
    converted before DeepSpeed wraps it, and the sync (and `save_model`'s FP8 checkpoint) gathers one module at a
    time. The first step computes exactly what DDP computes (the KL to the reference model 0), the ranks end
    identical, and each sampler and the checkpoint hold the learner's FP8 weights bit for bit."""
    # With TRL's default gradient checkpointing (which PEFT under ZeRO-3 makes reentrant) for LoRA and MoE.
    extra = {"dense": [], "lora": ["--lora", "--gradient_checkpointing"], "moe": ["--moe", "--gradient_checkpointing"]}
    flags = ["--beta", "--save_fp8", *extra[model]]
    ranks = launch_two_processes(SCRIPT, tmp_path / "zero3", *flags, config_file=ZERO3_CPU)
    assert [rank["zero_stage"] for rank in ranks] == [3, 3] and all(rank["sharded_at_start"] for rank in ranks)
    # Sharded between uses: every weight of the decoder layers (the test's config keeps no parameter whole), and the
    # reference model's siblings run alone too.
    empty = ranks[0]["empty_outside_a_gather"]
    weights = [n for n in ranks[0]["params"] if ".layers." in n and n.endswith(("_proj.weight", "base_layer.weight"))]
    assert len(weights) == (8 if model == "moe" else 14) and all(n in empty for n in weights), empty
    assert model != "moe" or all(f"model.layers.{i}.mlp.experts.gate_up_proj" in empty for i in (0, 1))
    assert not ranks[0]["ref_grouped"]
    # (transformers makes the MoE blocks leaves of its own: `...mlp`)
    lora_layers = [n for n in ranks[0]["zero3_leaves"] if n.endswith("_proj")]
    assert len(lora_layers) == (14 if model == "lora" else 0), ranks[0]["zero3_leaves"]
    assert_a_sharded_run_computes_what_ddp_does(ranks, tmp_path / "zero3", ddp_run(SCRIPT, *flags), model)


def assert_a_sharded_run_computes_what_ddp_does(ranks, output_dir, ddp, model: str) -> None:
    """The checks a sharded run (ZeRO-3, FSDP2) of the test script with `--beta --save_fp8` in `output_dir` passes,
    against `ddp`, DDP's run of the same flags (the `ddp_run` fixture's): identical ranks; samplers and the FP8
    checkpoint holding the learner's FP8 weights bit for bit; the first step exactly DDP's, the gradient norm to 1e-5
    (summed in another order: DeepSpeed reduces in fp32 buckets, FSDP reduce-scatters); every trained tensor moved."""
    params = ranks[0]["params"]
    for name, p0 in params.items():
        assert torch.equal(p0, ranks[1]["params"][name]), f"{name} differs between the ranks"
    linears = [f"model.layers.{i}.{m}_proj" for i in (0, 1) for m in ("self_attn.q", "self_attn.k", "self_attn.v")]
    for rank in ranks:
        assert all(f"{n}.weight_scale_inv" in rank["learner_fp8"] for n in linears)
        assert any(".experts.3.down_proj." in n for n in rank["learner_fp8"]) == (model == "moe")
        for name, t in rank["learner_fp8"].items():
            assert torch.equal(rank["sampler_fp8"][name].view(torch.uint8), t.view(torch.uint8)), name
    saved = load_file(output_dir / "fp8" / "model.safetensors")  # save_model(), fp8_save_format="fp8"
    for name, t in ranks[0]["learner_fp8"].items():
        assert torch.equal(saved[name].view(torch.uint8), t.view(torch.uint8)), name
    first, first_ddp = ([log for log in r[0]["log_history"] if "loss" in log][0] for r in (ranks, ddp))
    assert first["kl"] == 0.0  # the reference model computes what the policy computes, in FP8
    for key in ("loss", "kl", "entropy", "reward", "sampling/token_mult_prob_error"):
        assert first[key] == first_ddp[key], key
    assert first["grad_norm"] == pytest.approx(first_ddp["grad_norm"], rel=1e-5)
    trained = [n for n in params if "lora_" in n or model != "lora"]
    assert trained and all(not torch.equal(params[n], ranks[0]["initial"][n]) for n in trained)


def test_two_process_ddp_trains_fp8_lora_with_identical_adapters_and_samplers(tmp_path):
    ranks = run_two_processes(tmp_path, "--lora")
    params = ranks[0]["params"]
    assert any("lora_A" in n for n in params)
    for name, p0 in params.items():
        assert torch.equal(p0, ranks[1]["params"][name]), f"{name} differs between the ranks"
    errors = [log["sampling/token_mult_prob_error"] for log in ranks[0]["log_history"] if "loss" in log]
    assert len(errors) == 2 and max(errors) < 1.1, errors  # the FP8 KV cache is on: its rounding, not the weights
    # Every rank's sampler holds the learner's merged FP8 weights, the same on both ranks.
    sampler, learner = ranks[0]["sampler_fp8"], ranks[0]["learner_fp8"]
    assert set(learner) <= set(sampler) and any(n.endswith("weight_scale_inv") for n in learner)
    for name, t in learner.items():
        assert torch.equal(sampler[name].view(torch.uint8), t.view(torch.uint8)), name
        assert torch.equal(ranks[1]["sampler_fp8"][name].view(torch.uint8), t.view(torch.uint8)), name


RESUME = SCRIPT.with_name("resume_two_ranks.py")


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("zero2", marks=needs_deepspeed),
        pytest.param("zero3", marks=needs_deepspeed),
        pytest.param("fsdp2", marks=needs_fsdp2()),
    ],
)
def test_a_two_rank_run_resumed_from_its_checkpoint_ends_where_the_straight_run_does(tmp_path, layout):
    """A preempted job restarted from its last checkpoint (`train(resume_from_checkpoint=...)`) under the layouts that
    shard what a checkpoint holds: the optimizer states (ZeRO-2, the recipes'), the parameters too (ZeRO-3; FSDP2,
    whose checkpoints are sharded, `SHARDED_STATE_DICT`). The resumed trainer runs the one step left, on the weights
    and optimizer state it loaded (no FP8 weight quantized before the load survives it; each rank's FP8 KV cache
    recalibrated on the batch its checkpoint kept), and ends bit for bit where three straight steps end, on both
    ranks."""

    config = {"zero2": ZERO2_CPU, "zero3": ZERO3_CPU, "fsdp2": FSDP2_CPU}[layout]
    ranks = launch_two_processes(RESUME, tmp_path, config_file=config)
    for rank in ranks:
        assert rank["layout"] == layout and rank["resumed_steps"] == 1
        straight, resumed, interrupted = rank["straight"], rank["resumed"], rank["interrupted"]
        assert straight.keys() == resumed.keys()
        for name, p in straight.items():
            assert torch.equal(resumed[name], p), f"{name} differs after resuming"
            assert torch.equal(p, ranks[0]["straight"][name]), f"{name} differs between the ranks"
        # The last step moved every parameter: a resumed trainer that skipped it, or ran it on the initial weights,
        # would not end here.
        assert all(not torch.equal(interrupted[n], p) for n, p in straight.items())
        last, last_resumed = (
            [log for log in logs if "loss" in log][-1] for logs in (rank["straight_logs"], rank["resumed_logs"])
        )
        for key in ("loss", "grad_norm", "reward", "sampling/token_mult_prob_error", "step"):
            assert last[key] == last_resumed[key], key
