"""FP8 + LoRA through FP8GRPOTrainer, as a TRL user passes it (`peft_config=LoraConfig(...)`): the frozen base and
every adapted layer's merged weight run in FP8, only the adapters train, and the sampler holds what each layer
computes with, bit for bit. On the real tiny Llama, tokenizer and `datasets.Dataset`."""

import json
import statistics

import pytest
import torch
from conftest import tiny_grpo_args, tiny_policy
from peft import LoraConfig, PrefixTuningConfig, get_peft_model
from transformers import AutoModelForCausalLM

from trl_fp8 import FP8GRPOTrainer
from trl_fp8.demo.task import digit_count_reward, make_dataset
from trl_fp8.quant import FP8Linear, W8A8Linear, dequantize_blockwise, quantize_blockwise
from trl_fp8.quant.lora import FP8LoraLinear


def merged(layer) -> torch.Tensor:
    """W + s·B·A of the default adapter, written out."""
    lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return (layer.get_base_layer().weight + (lora_b @ lora_a) * layer.scaling["default"]).detach()


def fp8_trainer(tmp_path, tokenizer, model, peft_config, **args) -> FP8GRPOTrainer:
    return FP8GRPOTrainer(
        model=model,
        reward_funcs=digit_count_reward,
        args=tiny_grpo_args(tmp_path, **args),
        train_dataset=make_dataset(16),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def lora_trainer(tmp_path, tokenizer, lora=None, model=None, **args):
    """A fresh tiny policy with LoRA on every linear (`lora` overrides), or `model` (a PeftModel) as it is."""
    lora = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0, **(lora or {})}
    if model is not None:
        return fp8_trainer(tmp_path, tokenizer, model, None, **args)
    return fp8_trainer(tmp_path, tokenizer, tiny_policy(tokenizer), LoraConfig(**lora), **args)


def adapted_layers(trainer):
    base = trainer.model.get_base_model()
    return {name: m for name, m in base.named_modules() if hasattr(m, "lora_A")}


def test_only_the_adapters_train_and_the_sampler_holds_each_layers_fp8_weight(tmp_path, demo_tokenizer):
    trainer = lora_trainer(tmp_path, demo_tokenizer, max_steps=3)
    layers = adapted_layers(trainer)
    assert len(layers) == 14 and all(isinstance(m, FP8LoraLinear) for m in layers.values())
    assert all(isinstance(m.get_base_layer(), FP8Linear) for m in layers.values())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]) != ("lora_" in name), name  # adapters moved, nothing else did
    errors = [log["sampling/token_mult_prob_error"] for log in trainer.state.log_history if "loss" in log]
    # One FP8 grid for learner and sampler (checked bit for bit below): the mismatch sits at fp32 rounding noise, but
    # for a rare step where such noise (the learner's full forward and the sampler's cached decode sum in another
    # order, which depends on the CPU's kernels) carries an activation across an E4M3 rounding boundary: one step
    # of three reached 1.0025 on an AVX-512 Xeon (log-probs up to 0.04 apart), where an AMD EPYC stayed under 1.001.
    assert len(errors) == 3 and statistics.median(errors) < 1.0001 and max(errors) < 1.01, errors
    engine = trainer.vllm_generation
    engine.sync_weights()
    for name, layer in layers.items():
        q, s = layer.quantized_weight()
        q_ref, s_ref = quantize_blockwise(merged(layer), (128, 128))
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), name  # Q(W + s·B·A), current
        held = engine.sampler.get_submodule(name)
        assert isinstance(held, W8A8Linear), name
        assert torch.equal(held.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(
            held.weight_scale_inv, s
        )
    # The stream is the plain model's: the same names and bytes as without PEFT.
    log = next(log for log in trainer.state.log_history if "loss" in log)
    assert log["fp8/sync_bytes"] == sum(t.numel() * t.element_size() for _, t in engine.state_stream())
    assert not any("lora" in n or "base_layer" in n for n, _ in engine.state_stream())


@pytest.mark.parametrize("fp8_training", [False, True], ids=["fp8_generation_only", "end_to_end"])
def test_a_high_precision_sampler_or_learner_gets_the_merged_weights(tmp_path, demo_tokenizer, fp8_training):
    if fp8_training:  # an FP8 learner behind a high-precision sampler: the merged master weights
        trainer = lora_trainer(tmp_path, demo_tokenizer, {"target_modules": ["q_proj"]}, fp8_generation=False)
    else:  # a PEFT learner in high precision (PEFT's forward: dropout is fine), an FP8 sampler: the merged weights
        lora = {"target_modules": ["q_proj"], "lora_dropout": 0.05}  # quantized by the recipe
        trainer = lora_trainer(tmp_path, demo_tokenizer, lora, fp8_training=False)
    trainer.train()
    engine = trainer.vllm_generation
    engine.sync_weights()
    for name, layer in adapted_layers(trainer).items():
        held = engine.sampler.get_submodule(name)
        if fp8_training:
            assert torch.equal(held.weight, merged(layer)), name
        else:
            q, s = quantize_blockwise(merged(layer), (128, 128))
            assert torch.equal(held.weight.view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(held.weight_scale_inv, s), name


def test_kl_to_the_base_model_with_adapters_disabled(tmp_path, demo_tokenizer):
    """With PEFT, TRL's reference log-probs come from the policy with its adapters disabled: the FP8 base alone."""
    trainer = lora_trainer(tmp_path, demo_tokenizer, beta=0.1, max_steps=3)
    assert trainer.ref_model is None
    trainer.train()
    kls = [log["kl"] for log in trainer.state.log_history if "kl" in log]
    assert kls[0] == 0 and max(kls) > 0  # adapters start at B = 0, then move away from the base


def test_the_fp8_checkpoint_holds_the_merged_weights(tmp_path, demo_tokenizer):
    trainer = lora_trainer(tmp_path, demo_tokenizer, max_steps=1, fp8_save_format="fp8")
    trainer.train()
    out = tmp_path / "fp8"
    trainer.save_model(str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == ["lm_head"]
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # dequantized on CPU
    for name, layer in adapted_layers(trainer).items():
        got = loaded.get_submodule(name).weight
        assert torch.equal(got, dequantize_blockwise(*layer.quantized_weight()).to(got.dtype)), name
    # Checkpoints during training are PEFT's: the adapters alone.
    trainer.save_model(str(tmp_path / "checkpoint"), _internal_call=True)
    assert (tmp_path / "checkpoint" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "checkpoint" / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (
            {"lora_dropout": 0.05},
            r"LoraConfig.lora_dropout=0.05 is not supported by FP8GRPOTrainer: with fp8_training",
        ),
        ({"use_dora": True}, r"LoraConfig.use_dora=True is not supported"),
        ({"modules_to_save": ["lm_head"]}, r"LoraConfig.modules_to_save=\['lm_head'\] is not supported"),
    ],
    ids=["dropout", "dora", "modules_to_save"],
)
def test_adapters_fp8_cannot_merge_are_refused_before_the_model_is_touched(tmp_path, demo_tokenizer, lora, message):
    model = tiny_policy(demo_tokenizer)
    with pytest.raises(ValueError, match=message):
        fp8_trainer(
            tmp_path, demo_tokenizer, model, LoraConfig(**{"target_modules": ["q_proj"], "lora_dropout": 0.0, **lora})
        )
    assert not any("lora" in name for name, _ in model.named_modules())


def test_other_peft_methods_and_unmergeable_peft_models_are_refused(tmp_path, demo_tokenizer):
    with pytest.raises(ValueError, match=r"peft_config: FP8GRPOTrainer supports LoraConfig, not PrefixTuningConfig"):
        fp8_trainer(
            tmp_path,
            demo_tokenizer,
            tiny_policy(demo_tokenizer),
            PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        )
    peft_model = get_peft_model(tiny_policy(demo_tokenizer), LoraConfig(target_modules=["v_proj"], lora_dropout=0.1))
    with pytest.raises(ValueError, match=r"layers.0.self_attn.v_proj: LoraConfig.lora_dropout must be 0"):
        lora_trainer(tmp_path, demo_tokenizer, model=peft_model)


def test_resume_from_an_adapter_checkpoint_continues_with_the_same_numbers(tmp_path, demo_tokenizer):
    """Checkpoints hold the adapters and the optimizer (W is frozen and comes from the model again): resuming
    re-makes each layer's merged FP8 weight from the loaded adapters and ends where an uninterrupted run ends."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 2

    straight = lora_trainer(tmp_path / "a", demo_tokenizer, max_steps=3)
    straight.train()
    first = lora_trainer(tmp_path / "b", demo_tokenizer, max_steps=3, save_strategy="steps", save_steps=2)
    first.add_callback(StopAt())
    first.train()
    assert first.state.global_step == 2
    resumed = lora_trainer(tmp_path / "b", demo_tokenizer, max_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    ours, theirs = dict(resumed.model.named_parameters()), dict(straight.model.named_parameters())
    for name, p in theirs.items():
        torch.testing.assert_close(ours[name], p, rtol=0, atol=0, msg=f"{name} differs after resuming")
    for name, layer in adapted_layers(resumed).items():
        assert torch.equal(layer.quantized_weight()[1], adapted_layers(straight)[name].quantized_weight()[1]), name


@pytest.mark.parametrize("fp8_training", [True, False], ids=["end_to_end", "fp8_generation_only"])
@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"target_modules": ["embed_tokens", "q_proj"]}, r"model.embed_tokens: Embedding adapters are not supported"),
        ({"alora_invocation_tokens": [5]}, r"model.layers.0.self_attn.q_proj: LoRA variant ALoraLinearVariant"),
    ],
    ids=["embedding", "alora"],
)
def test_what_peft_would_build_is_checked_before_the_model_is_wrapped(
    tmp_path, demo_tokenizer, lora, message, fp8_training
):
    """TRL wraps the model in place: the adapters PEFT would build are checked first, on an empty copy of the
    architecture, whether or not the learner trains in FP8 (the sampler needs one mergeable weight either way)."""
    model = tiny_policy(demo_tokenizer)
    with pytest.raises(ValueError, match=message):
        fp8_trainer(
            tmp_path,
            demo_tokenizer,
            model,
            LoraConfig(**{"target_modules": ["q_proj"], "lora_dropout": 0.0, **lora}),
            fp8_training=fp8_training,
        )
    assert not any("lora" in name for name, _ in model.named_modules())
    assert not any(isinstance(m, FP8Linear) for m in model.modules())


def test_lora_on_a_tied_output_embedding_is_refused(tmp_path, demo_tokenizer):
    """The sampler holds one tensor for `lm_head.weight` and `model.embed_tokens.weight`: the adapter would be lost."""
    model = tiny_policy(demo_tokenizer)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"lm_head: LoRA on a weight tied to another \(model.embed_tokens.weight"):
        fp8_trainer(
            tmp_path, demo_tokenizer, model, LoraConfig(target_modules=["q_proj", "lm_head"], lora_dropout=0.0)
        )


def test_switching_adapters_or_their_scale_refits_the_sampler(tmp_path, demo_tokenizer):
    """`set_adapter` and `set_scale` change the weights the layers compute with but no parameter: the engine still
    sees the change and refits."""
    trainer = lora_trainer(tmp_path, demo_tokenizer, {"target_modules": ["q_proj"]}, max_steps=1)
    trainer.train()  # the default adapter's B moves away from zero
    peft_model, engine = trainer.model, trainer.vllm_generation
    peft_model.add_adapter("other", LoraConfig(target_modules=["q_proj"], lora_dropout=0.0))
    layer = adapted_layers(trainer)["model.layers.1.self_attn.q_proj"]
    held = engine.sampler.get_submodule("model.layers.1.self_attn.q_proj")

    def sampler_holds_the_layers_weight():
        engine.sync_weights()
        return torch.equal(held.weight.view(torch.uint8), layer.quantized_weight()[0].view(torch.uint8))

    assert sampler_holds_the_layers_weight()
    before = held.weight.clone()
    peft_model.base_model.set_adapter("other")  # B = 0: the base weight alone
    assert sampler_holds_the_layers_weight() and not torch.equal(
        held.weight.view(torch.uint8), before.view(torch.uint8)
    )
    peft_model.base_model.set_adapter("default")
    layer.set_scale("default", 3.0)
    assert sampler_holds_the_layers_weight()
