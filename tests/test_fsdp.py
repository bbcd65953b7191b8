"""FSDP2 (`fully_shard`) on two CPU processes through `accelerate launch`, against DDP. accelerate takes FSDP only on
accelerator devices, so the test script lifts that one gate (tests/scripts/fsdp_on_cpu.py); FSDP2 then shards, gathers
and reduces for real, over gloo. The KV-scale calibration FSDP2 needs (through the outermost module) runs here too."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import launch_two_processes, needs_fsdp2, tiny_policy
from peft import LoraConfig, get_peft_model
from test_distributed import FSDP2_CPU, SCRIPT, assert_a_sharded_run_computes_what_ddp_does
from transformers import AutoModelForCausalLM

from trl_fp8 import convert_to_fp8
from trl_fp8.demo.make_model import build_tokenizer
from trl_fp8.demo.task import DEMO_MODEL_DIR
from trl_fp8.quant.kv_cache import calibrate_kv_scales


@needs_fsdp2()
@pytest.mark.xdist_group("ddp_run")  # with ZeRO-3's: the DDP baselines they share
@pytest.mark.parametrize(
    "model", ["dense", "lora", "moe", "moe_gradient_checkpointing", "dense_activation_checkpointing"]
)
def test_two_process_fsdp2_computes_what_ddp_does(tmp_path, model, ddp_run):
    """FSDP2 (TRL's fsdp2.yaml settings: a unit per decoder layer, embeddings and head in units of their own) shards
    every parameter between uses. Each FP8 module quantizes the weight FSDP unshards for it and caches none (sibling
    linears run alone), the reference model is converted before TRL's `prepare_fsdp` wraps it, and the sync (and
    `save_model`'s FP8 checkpoint) unshards one unit at a time, each unit once. The first step computes
    exactly what DDP computes (the KL to the reference model 0), the ranks end identical, and each sampler and the
    checkpoint hold the learner's FP8 weights bit for bit. With FSDP's activation checkpointing too (its wrappers
    around the decoder layers set aside while the stream reads the learner)."""
    # LoRA with TRL's default gradient checkpointing; MoE with and without it (without, what its experts save for
    # the backward outlives FSDP's reshard after the forward).
    extra = {
        "lora": ["--lora", "--gradient_checkpointing"],
        "moe": ["--moe"],
        "moe_gradient_checkpointing": ["--moe", "--gradient_checkpointing"],
    }
    flags = ["--beta", "--save_fp8", *extra.get(model, [])]
    kind = model.partition("_")[0]  # dense, lora or moe
    config = FSDP2_CPU
    if model == "dense_activation_checkpointing":  # FSDP's own (accelerate wraps each decoder layer), not TRL's
        config = tmp_path / "fsdp2_ac.yaml"
        text = FSDP2_CPU.read_text()
        config.write_text(text.replace("fsdp_activation_checkpointing: false", "fsdp_activation_checkpointing: true"))
    ranks = launch_two_processes(SCRIPT, tmp_path / "fsdp2", *flags, config_file=config)
    # The wrappers' names (`..._checkpoint_wrapped_module...`) never reach the stream, the sampler or the checkpoint.
    assert ranks[0]["activation_wrappers"] == (2 if model == "dense_activation_checkpointing" else 0)
    params = ranks[0]["params"]
    for rank in ranks:
        assert rank["fsdp"] and rank["world_size"] == 2
        # Every parameter sharded by FSDP (a DTensor), no FP8 weight cached; read without a gather, the shards are
        # refused, naming one.
        assert sorted(rank["dtensors"]) == sorted(params)
        assert "is an FSDP2 shard (a DTensor): pass gather=" in rank["stream_without_gather"]
        assert rank["marked_sharded"] == (8 if kind == "moe" else 14) and rank["fp8_caches"] == 0
        assert rank["other_fp8_caches"] == 0 and not rank["ref_grouped"]
        # What the stream sends is the quantization of the master weights (fp32: the quantization of the whole
        # parameter) after the last optimizer step, not of stale or partial ones.
        fresh = rank["fresh_fp8_weights"]
        assert len(fresh) == {"lora": 0, "moe": 8}.get(kind, 14) and all(fresh), fresh
        # A gather holds one layer whole at a time, and `close()` reshards it.
        assert rank["gather_states"] == [[True, False], [False, True], [False, False]], rank["gather_states"]
        # A sync all-gathers each unit once (its linears and norms read together): the embeddings, two decoder
        # layers, the final norm with the head (and, with PEFT, its wrapper's own).
        unshards = (rank["sync_unshards"], rank["sync_units"])
        assert unshards[0] == unshards[1] == (5 if kind == "lora" else 4), unshards
    assert_a_sharded_run_computes_what_ddp_does(ranks, tmp_path / "fsdp2", ddp_run(SCRIPT, *flags), kind)


@pytest.mark.parametrize("wrapper", ["causal_lm", "peft"])
def test_kv_calibration_through_the_outermost_module_measures_what_the_decoder_does(wrapper):
    """FSDP2 unshards the embeddings in its outermost module's forward, which must run before any other: calibration
    then runs the causal LM (or its PEFT wrapper), its head on the last position only, and measures the same scales
    as through the decoder alone, bit for bit."""
    tokenizer = build_tokenizer()
    model = convert_to_fp8(tiny_policy(tokenizer))
    ids = torch.randint(0, len(tokenizer), (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    expected = calibrate_kv_scales(model.get_decoder(), ids, mask)
    outer = model if wrapper == "causal_lm" else get_peft_model(model, LoraConfig(target_modules=["q_proj"]))
    assert torch.equal(calibrate_kv_scales(outer, ids, mask), expected)


@needs_fsdp2()
def test_the_example_trains_under_fsdp2_and_saves_a_whole_checkpoint(tmp_path):
    """`examples/grpo_fp8.py` under TRL's FSDP2 settings with sharded checkpoints (`SHARDED_STATE_DICT`) on two
    processes: it trains, and its final `save_model` writes one checkpoint gathered from the shards (the script sets
    `FULL_STATE_DICT` first), which transformers loads whole, with the trained weights."""
    root = SCRIPT.parents[2]
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP2_CPU),
        "--main_process_port", "0",  # a free port, which accelerate picks (its default 29500 may be in use)
        str(SCRIPT.with_name("fsdp_on_cpu.py")), str(root / "examples" / "grpo_fp8.py"),
        "--config", str(root / "recipes" / "demo_cpu.yaml"), "--output_dir", str(tmp_path), "--max_steps", "2",
        "--per_device_train_batch_size", "16", "--no_plot", "--report_to", "none",
    ]  # fmt: skip
    # faulthandler: a rank that dies on a signal prints every thread's Python stack. Rank 1 aborted in Python's
    # teardown after training and saving (gloo's worker threads; fsdp_on_cpu.py says why and now leaves without it).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    fatal = result.stderr.find("Fatal Python error")  # faulthandler's report, ahead of torchrun's summary
    assert result.returncode == 0, result.stderr[fatal : fatal + 4000] if fatal >= 0 else result.stderr[-4000:]
    assert "token_mult_prob_error: mean 1.0000" in result.stdout  # one FP8 grid, sampler and learner
    saved = AutoModelForCausalLM.from_pretrained(tmp_path)
    start = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR)
    moved = [n for n, p in saved.named_parameters() if not torch.equal(p, start.get_parameter(n))]
    assert len(moved) == len(list(start.parameters()))  # every tensor whole, and trained
