"""Checkpoints in the course of training: push_to_hub (the Hub replaced by a recorder), LoRA runs' pushes, loading the
original layout, load_best_model_at_end with MoE experts, and resume_from_checkpoint continuing with the same
numbers."""

import itertools
import json
from pathlib import Path

import pytest
import torch
import transformers.trainer
from conftest import digit_trainer, tiny_grpo_args, tiny_policy
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_fp8 import FP8GRPOTrainer, FP8Recipe, convert_to_fp8
from trl_fp8.demo.task import digit_count_reward as digit_reward
from trl_fp8.demo.task import make_dataset
from trl_fp8.demo.tiny_moe import tiny_qwen3_moe
from trl_fp8.quant import dequantize_blockwise, iter_fp8_state
from trl_fp8.trainers.checkpoints import checkpoint_keys


def test_push_to_hub_uploads_the_fp8_checkpoint(tmp_path, demo_tokenizer, monkeypatch):
    """The Hub cannot be reached here: its upload is replaced by a recorder of what the folder holds when it would be
    uploaded (the one stand-in). Trainer.push_to_hub saves before uploading, and that save must be the FP8 one."""
    uploads = []

    class Recorder:
        def upload_folder(self, folder_path, **kwargs):
            config = json.loads((Path(folder_path) / "config.json").read_text())
            state = load_file(Path(folder_path) / "model.safetensors")
            uploads.append((config.get("quantization_config"), {t.dtype for t in state.values()}))

    monkeypatch.setattr(transformers.trainer, "hf_api", Recorder)
    trainer = digit_trainer(tmp_path, demo_tokenizer, max_steps=1, fp8_save_format="fp8")
    trainer.train()
    trainer.hub_model_id = "someone/tiny-fp8"  # as Trainer.init_hf_repo would have set it (it creates the repo)
    trainer.push_to_hub()
    trainer.args.push_to_hub = True
    trainer.save_model(str(tmp_path / "elsewhere"))  # writes there, then pushes output_dir, as Trainer.save_model does
    assert json.loads((tmp_path / "elsewhere" / "config.json").read_text())["quantization_config"]
    assert len(uploads) == 2
    for quantization_config, dtypes in uploads:
        assert quantization_config["quant_method"] == "fp8" and torch.float8_e4m3fn in dtypes
    # Checkpoints during training still hold the master weights.
    trainer.args.push_to_hub = False
    trainer.save_model(str(tmp_path / "checkpoint"), _internal_call=True)
    assert "quantization_config" not in json.loads((tmp_path / "checkpoint" / "config.json").read_text())


def test_pushes_during_lora_training_leave_no_adapter_beside_the_final_fp8_checkpoint(
    tmp_path, demo_tokenizer, monkeypatch
):
    """With `hub_strategy="every_save"` Trainer copies each checkpoint's adapter into `output_dir` and uploads it. The
    final FP8 checkpoint (adapters merged) replaces it, locally and in the repository: left there, transformers would
    load the adapter a second time on top of the merged weights (or, from the Hub, the adapter's base model instead
    of them). The Hub cannot be reached: its upload is replaced by a recorder (the one stand-in)."""
    from peft import LoraConfig

    uploads = []

    class Recorder:
        def upload_folder(self, folder_path, **kwargs):
            uploads.append((sorted(p.name for p in Path(folder_path).iterdir()), kwargs.get("delete_patterns")))
            return Done()

    class Done:
        def done(self):
            return True

    monkeypatch.setattr(transformers.trainer, "hf_api", Recorder)
    trainer = FP8GRPOTrainer(
        model=tiny_policy(demo_tokenizer),
        reward_funcs=digit_reward,
        args=tiny_grpo_args(tmp_path, max_steps=2, fp8_save_format="fp8", save_strategy="steps", save_steps=1),
        train_dataset=make_dataset(16),
        processing_class=demo_tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0),
    )
    trainer.args.push_to_hub = True  # as push_to_hub=True would (Trainer.init_hf_repo creates the repository)
    trainer.hub_model_id, trainer.push_in_progress = "someone/tiny-fp8-lora", None
    trainer.train()
    assert "adapter_model.safetensors" in uploads[-1][0] and uploads[-1][1] is None  # a checkpoint's push
    with pytest.warns(UserWarning, match=r"held adapter_config.json, adapter_model.safetensors from an earlier save"):
        trainer.save_model()  # the example script's last step: writes output_dir, then pushes it
    files, deleted = uploads[-1]
    assert "adapter_config.json" not in files and "adapter_model.safetensors" not in files
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(deleted) and "model.safetensors" not in deleted
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not any("lora_" in name for name, _ in loaded.named_parameters())
    name = "model.layers.0.self_attn.q_proj"
    # (transformers dequantizes block-FP8 checkpoints on CPU): the merged weight the FP8 layer computed with
    expected = dequantize_blockwise(*trainer.model.get_base_model().get_submodule(name).quantized_weight())
    assert torch.equal(loaded.get_submodule(name).weight.detach(), expected)


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def test_a_checkpoint_in_the_original_layout_loads_whole_or_not_at_all(tmp_path, demo_tokenizer):
    """`load_converted_checkpoint`: a plain model's checkpoint is left to the Trainer's `load_state_dict`; a MoE's
    (experts one by one on disk) loads through `from_pretrained`, every tensor in its own dtype; one that lacks a
    tensor of the model is refused, naming it, before the model is touched."""
    from trl_fp8.trainers.checkpoints import load_converted_checkpoint

    tiny_policy(demo_tokenizer).save_pretrained(tmp_path / "dense")
    assert not load_converted_checkpoint(tiny_policy(demo_tokenizer), str(tmp_path / "dense"))
    saved = tiny_qwen3_moe(demo_tokenizer, seed=1)
    saved.save_pretrained(tmp_path / "moe")
    model = convert_to_fp8(tiny_qwen3_moe(demo_tokenizer, seed=2), FP8Recipe())
    assert load_converted_checkpoint(model, str(tmp_path / "moe"))
    for name, t in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    # Mixed dtypes (bf16 layers, an fp32 lm_head as `cast_lm_head_to_fp32` makes them): each tensor exactly.
    mixed = tiny_qwen3_moe(demo_tokenizer, seed=1).to(torch.bfloat16)
    mixed.lm_head.float().weight.data.normal_(std=0.02)  # values bf16 cannot hold
    mixed.save_pretrained(tmp_path / "mixed")
    model = tiny_qwen3_moe(demo_tokenizer, seed=2).to(torch.bfloat16)
    model.lm_head.float()
    assert load_converted_checkpoint(model, str(tmp_path / "mixed"))
    for name, t in mixed.state_dict().items():
        assert model.state_dict()[name].dtype == t.dtype and torch.equal(model.state_dict()[name], t), name
    # A tensor the checkpoint lacks (from_pretrained would initialize it afresh) or a model with more: refused,
    # naming them, before the model is touched.
    weights = load_file(tmp_path / "moe" / "model.safetensors")
    del weights["model.layers.0.self_attn.q_proj.weight"]
    save_file(weights, tmp_path / "moe" / "model.safetensors", metadata={"format": "pt"})
    deeper = tiny_qwen3_moe(demo_tokenizer, seed=2)
    deeper.model.layers.append(deeper.model.layers[-1])
    for target, name in ((tiny_qwen3_moe(demo_tokenizer, seed=2), "layers.0.self_attn.q_proj"), (deeper, "layers.2.")):
        before = {n: t.clone() for n, t in target.state_dict().items()}
        with pytest.raises(RuntimeError, match=rf"load_best_model_at_end: .* does not hold every tensor of "
                           rf"Qwen3MoeForCausalLM once converted: missing \[.*'model\.{name}"):  # fmt: skip
            load_converted_checkpoint(target, str(tmp_path / "moe"), "load_best_model_at_end")
        assert all(torch.equal(t, before[n]) for n, t in target.state_dict().items())


def test_load_best_model_at_end_restores_a_moes_experts(tmp_path, demo_tokenizer):
    """`load_best_model_at_end` reads the best checkpoint as a resume does (a MoE's through `from_pretrained`): the
    run ends holding every tensor of that checkpoint, the first here (each call of the reward scores lower), not the
    experts of the last step."""
    calls = itertools.count()

    def falling(completions, **kwargs):
        call = next(calls)
        return [0.1 * i - call for i in range(len(completions))]  # distinct within a group, lower at every call

    args = tiny_grpo_args(
        tmp_path, learning_rate=0.05, max_steps=3, save_strategy="steps", save_steps=1, eval_strategy="steps",
        eval_steps=1, per_device_eval_batch_size=4, load_best_model_at_end=True, metric_for_best_model="reward",
    )  # fmt: skip
    trainer = FP8GRPOTrainer(
        model=tiny_qwen3_moe(demo_tokenizer), reward_funcs=falling, args=args, train_dataset=make_dataset(32),
        eval_dataset=make_dataset(8, seed=1), processing_class=demo_tokenizer,
    )  # fmt: skip
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    best = AutoModelForCausalLM.from_pretrained(trainer.state.best_model_checkpoint).state_dict()
    last = load_file(tmp_path / "checkpoint-3" / "model.safetensors")
    assert any(
        not torch.equal(t, last[n]) for n, t in load_file(tmp_path / "checkpoint-1" / "model.safetensors").items()
    )
    for name, t in trainer.model.state_dict().items():
        assert torch.equal(t, best[name]), f"{name} is not the best checkpoint's"
    # And so does the sampler, at the next generation: loading changed the weights but not `global_step`, by which
    # TRL decides to refit.
    trainer.evaluate()
    held = trainer.vllm_generation.sampler.state_dict()
    stale = [n for n, t in iter_fp8_state(trainer.model) if not torch.equal(held[n], t.to(held[n].dtype))]
    assert not stale, f"the sampler still holds the last step's {stale[:3]}"


@pytest.mark.parametrize(
    "kv_cache,eval_on_start,moe",
    [(False, False, False), (True, False, False), (True, True, False), (False, False, True)],
    ids=["bf16_kv", "fp8_kv", "eval_on_start", "moe"],
)
def test_resume_from_checkpoint_continues_with_the_same_numbers(
    tmp_path, demo_tokenizer, kv_cache, eval_on_start, moe
):
    """With the FP8 KV cache, the checkpoint keeps the batch its next recalibration runs on (beside the RNG state):
    the resumed run's first scales are the ones the straight run used, also when an evaluation on start (before
    the Trainer restores the RNG states) generates first. A MoE's checkpoint holds its experts one by one (the
    original layout `save_pretrained` writes), which the Trainer's own loading would not read back: they are
    restored through `from_pretrained`. (Two ranks: tests/test_distributed.py.)"""
    evaluation = {}
    if eval_on_start:  # no other evaluation within the 3 steps
        evaluation = dict(eval_strategy="steps", eval_steps=100, eval_on_start=True, per_device_eval_batch_size=4)

    def trainer_for(output_dir, **overrides):
        return FP8GRPOTrainer(
            model=tiny_qwen3_moe(demo_tokenizer) if moe else tiny_policy(demo_tokenizer),
            reward_funcs=digit_reward,
            args=tiny_grpo_args(output_dir, learning_rate=0.05, max_steps=3, fp8_kv_cache=kv_cache, **evaluation,
                                **overrides),
            train_dataset=make_dataset(32),
            eval_dataset=make_dataset(8, seed=1) if eval_on_start else None,
            processing_class=demo_tokenizer,
        )  # fmt: skip

    straight = trainer_for(tmp_path / "a")
    straight.train()
    # Same schedule (max_steps=3), interrupted after the checkpoint at step 2.
    first = trainer_for(tmp_path / "b", save_strategy="steps", save_steps=2)
    first.add_callback(StopAt(2))
    first.train()
    assert first.state.global_step == 2
    kept = tmp_path / "b" / "checkpoint-2" / "fp8_kv_calibration.pt"
    assert kept.is_file() == kv_cache
    saved_keys = checkpoint_keys(str(tmp_path / "b" / "checkpoint-2"))
    assert any(".mlp.experts.0.gate_proj." in k for k in saved_keys) == moe
    resumed = trainer_for(tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    for (name, p), q in zip(straight.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"{name} differs after resuming")
    if kv_cache:  # the last sync's scales: calibrated on the kept batch, with the weights after step 2
        torch.testing.assert_close(
            resumed.vllm_generation._kv_scale_invs, straight.vllm_generation._kv_scale_invs, rtol=0, atol=0
        )
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "b" / "checkpoint-2" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in saved.values()) and not any("_extra_state" in k for k in saved)
