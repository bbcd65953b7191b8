"""What FP8GRPOTrainer and FP8GRPOConfig refuse, and when: contradicting options, setups that cannot run here, a
policy or recipe that would change under the user's feet, all named before anything is loaded or converted; and the
defaults a plain GRPOConfig user gets."""

from pathlib import Path

import pytest
import torch
from conftest import digit_trainer, tiny_grpo_args, tiny_policy, train_and_check
from datasets import Dataset
from peft import LoraConfig

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Recipe, convert_to_fp8
from trl_fp8.demo.task import digit_count_reward as digit_reward
from trl_fp8.demo.task import make_dataset
from trl_fp8.quant import FP8Linear
from trl_fp8.trainers.checks import check_fsdp_supported, check_not_quantized


def test_config_defaults_and_contradictions(tmp_path):
    args = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert args.vllm_importance_sampling_mode == "token_truncate"
    assert args.vllm_importance_sampling_clip_max == 2.0
    assert args.resolved_fp8_recipe == FP8Recipe()
    assert FP8GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, fp8_recipe='{"pow2_scales": true}'
    ).resolved_fp8_recipe.pow2_scales
    with pytest.raises(ValueError, match="vllm_mode='server' is not supported"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_mode="server")
    with pytest.raises(ValueError, match="cache_implementation='static' conflicts with fp8_kv_cache=True"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_kv_cache=True, cache_implementation="static")
    with pytest.raises(ValueError, match="use_transformers_continuous_batching"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match="loss_type='vespo' needs vllm_importance_sampling_mode"):
        FP8GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, loss_type="vespo", vllm_importance_sampling_mode="sequence_mask"
        )
    with pytest.raises(ValueError, match=r"fp8_recipe: unknown FP8Recipe fields \['blocks'\]"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_recipe={"blocks": 3})
    with pytest.raises(ValueError, match=r"generation_kwargs\['num_return_sequences'\] is set by .*num_generations"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, generation_kwargs={"num_return_sequences": 2})
    with pytest.raises(ValueError, match=r"generation_kwargs\['num_beams'\] is set by .*; remove it \(GRPO samples"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, generation_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match=r"fp8_recipe: expected an FP8Recipe, a dict .* got int 123"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_recipe=123)
    # The samplers take 128x128 blocks only: refused here, not at the first weight sync after loading everything.
    blocks = {"weight_block_size": [64, 64], "backend": "emulated"}
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] needs fp8_generation=False"):
        FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_recipe=blocks)
    assert FP8GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, fp8_recipe=blocks, fp8_generation=False
    ).resolved_fp8_recipe.weight_block_size == [64, 64]
    for field, value, message in (
        ("fp8_save_format", "fp16", "fp8_save_format must be 'bf16' or 'fp8', got 'fp16'"),
        ("fp8_kv_scale_margin", 0.0, "fp8_kv_scale_margin must be positive and finite, got 0.0"),
        # An infinite margin made every KV scale inf, refused only at the first sync, naming the scales.
        ("fp8_kv_scale_margin", float("inf"), "fp8_kv_scale_margin must be positive and finite, got inf"),
        ("fp8_kv_scale_percentile", 0.0, r"fp8_kv_scale_percentile must be in \(0, 100\]"),
        ("fp8_kv_scale_percentile", float("nan"), r"fp8_kv_scale_percentile must be in \(0, 100\], got nan"),
        ("fp8_kv_scale_percentile", "99", r"fp8_kv_scale_percentile must be in \(0, 100\], got '99'"),
        ("fp8_kv_calibration_rows", 0, "fp8_kv_calibration_rows must be an int, at least 1, got 0"),
        # A float failed at the first generation with "'float' object cannot be interpreted as an integer".
        ("fp8_kv_calibration_rows", 1.5, "fp8_kv_calibration_rows must be an int, at least 1, got 1.5"),
        # A string from Python code was truthy: "false" trained in FP8.
        ("fp8_training", "false", "fp8_training must be True or False, got 'false'"),
        ("fp8_kv_cache", 1, "fp8_kv_cache must be True or False, got 1"),
        # TRL reads these at the first generation, after loading everything, and takes a negative cap (every token's
        # weight then changes sign).
        ("vllm_importance_sampling_mode", "TOKEN_TRUNCATE", "vllm_importance_sampling_mode must be one of"),
        ("vllm_importance_sampling_clip_max", -1.0, "vllm_importance_sampling_clip_max must be positive and finite"),
        ("vllm_importance_sampling_clip_min", -0.5, "vllm_importance_sampling_clip_min must be non-negative"),
    ):
        with pytest.raises(ValueError, match=message):
            FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})
    # Flags are checked before the checks between fields read them, which named the opposite setting.
    for fields, message in (
        (dict(fp8_kv_cache="false", fp8_generation=False), "fp8_kv_cache must be True or False, got 'false'"),
        (dict(fp8_generation="false", fp8_recipe={"weight_block_size": [64, 64]}), "fp8_generation must be True or"),
    ):
        with pytest.raises(ValueError, match=message):
            FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **fields)
    # A recipe changed after it was handed over changes neither what the run uses nor what it records.
    recipe = FP8Recipe()
    config = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_recipe=recipe)
    recipe.weight_block_size = [64, 64]
    assert config.resolved_fp8_recipe == FP8Recipe() and config.fp8_recipe == FP8Recipe().to_dict()
    # The edges that are allowed: the KV scale at the calibration's plain maximum, vespo with per-token masking, and
    # vespo with a sequence mode while the correction that mode names is off.
    FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, fp8_kv_scale_percentile=100)
    FP8GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_max=None, vllm_importance_sampling_clip_min=0.0,
    )  # fmt: skip
    FP8GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, loss_type="vespo", vllm_importance_sampling_mode="token_mask"
    )
    FP8GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, loss_type="vespo", vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_correction=False,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "te"])
def test_a_backend_that_cannot_run_here_is_refused_before_anything_changes(tmp_path, demo_tokenizer, backend):
    """CPU training with backend='torch' (needs an SM90 GPU) or 'te': refused before GRPOTrainer loads anything or
    the user's model is converted."""
    model = tiny_policy(demo_tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = tiny_grpo_args(tmp_path, fp8_recipe={"backend": backend})
    with pytest.raises(RuntimeError, match=f"FP8 backend '{backend}' cannot run here"):
        FP8GRPOTrainer(
            model=model, reward_funcs=digit_reward, args=args, train_dataset=make_dataset(8),
            processing_class=demo_tokenizer,
        )  # fmt: skip
    assert not any(type(m).__name__ == "FP8Linear" for m in model.modules()) and not hasattr(model, "fp8_recipe")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_prompts_with_images_are_refused_at_start_for_the_reference_engine(tmp_path, demo_tokenizer):
    """The reference engine samples text only. A dataset with images (an `image` column, or image parts in its
    prompts' messages, TRL's two ways) is refused before anything is loaded or converted, naming the dataset; it used
    to fail only at the first generation."""
    from datasets import Image as ImageFeature
    from PIL import Image

    model = tiny_policy(demo_tokenizer)
    text = make_dataset(4)
    images = [ImageFeature().encode_example(Image.new("RGB", (8, 8))) for _ in range(4)]
    pictures = text.add_column("image", images, feature=ImageFeature())
    parts = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p}]}] for p in text["prompt"]
            ]
        }  # fmt: skip
    )
    kwargs = dict(
        model=model, reward_funcs=digit_reward, args=tiny_grpo_args(tmp_path), processing_class=demo_tokenizer
    )
    with pytest.raises(ValueError, match=r"^train_dataset has an 'image' column, but .* samples text only"):
        FP8GRPOTrainer(train_dataset=pictures, **kwargs)
    with pytest.raises(ValueError, match=r"^eval_dataset\['hard'\] has image parts in its first prompt"):
        FP8GRPOTrainer(train_dataset=text, eval_dataset={"easy": text, "hard": parts}, **kwargs)
    with pytest.raises(ValueError, match=r"^train_dataset has images in its first row's 'images'"):
        FP8GRPOTrainer(train_dataset=text.add_column("images", [[image] for image in images]), **kwargs)
    assert not any(isinstance(m, FP8Linear) for m in model.modules()) and not hasattr(model, "fp8_recipe")
    # An `images` column of empty lists holds no images, as TRL reads it: the text is trained on.
    FP8GRPOTrainer(train_dataset=text.add_column("images", [[] for _ in images]), **kwargs)
    assert hasattr(model, "fp8_recipe")


def test_the_constructor_takes_grpo_trainers_arguments_by_position(tmp_path, demo_tokenizer):
    """A drop-in for `GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, ...)`:
    the arguments after `args` are taken by position too, and the start-up checks read them wherever they were
    given."""
    from datasets import Image as ImageFeature
    from PIL import Image

    model, args, text = tiny_policy(demo_tokenizer), tiny_grpo_args(tmp_path), make_dataset(4)
    trainer = FP8GRPOTrainer(model, digit_reward, args, text, None, demo_tokenizer)
    assert trainer.train_dataset is text and trainer.processing_class is demo_tokenizer
    assert hasattr(model, "fp8_recipe")
    images = [ImageFeature().encode_example(Image.new("RGB", (8, 8))) for _ in range(4)]
    pictures = text.add_column("image", images, feature=ImageFeature())
    with pytest.raises(ValueError, match=r"^train_dataset has an 'image' column"):
        FP8GRPOTrainer(tiny_policy(demo_tokenizer), digit_reward, args, pictures, None, demo_tokenizer)
    with pytest.raises(TypeError, match="multiple values for argument 'train_dataset'"):
        FP8GRPOTrainer(model, digit_reward, args, text, train_dataset=text)


def test_ds3_gather_for_generation_off_is_refused_for_the_reference_engine(tmp_path):
    """`ds3_gather_for_generation=False` asks TRL to generate from ZeRO-3's partitions, to train a policy larger than
    one device; the reference engine samples from a whole copy, so the setting is refused rather than ignored. It is
    inert without ZeRO-3, and TRL does not take it with vLLM either: both pass, as in TRL."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    def config(stage: int, **kwargs) -> FP8GRPOConfig:
        zero = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}
        return FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, deepspeed=zero, **kwargs)

    try:  # (a DeepSpeed config in TrainingArguments is process-wide state in transformers: unset below)
        with pytest.raises(ValueError, match=r"ds3_gather_for_generation=False .* Set ds3_gather_for_generation=True"):
            config(3, ds3_gather_for_generation=False)
        config(3)
        config(3, ds3_gather_for_generation=False, use_vllm=True)
        config(2, ds3_gather_for_generation=False)
    finally:
        unset_hf_deepspeed_config()


def test_a_quantized_policy_is_refused_before_it_is_loaded(tmp_path, demo_tokenizer):
    """QLoRA's way (TRL's `quantization_config`, or in `model_init_kwargs`): refused while FP8 is on, naming where it
    was set, before transformers loads anything (bitsandbytes is not even installed here: loading would fail on
    that instead); with FP8 off, FP8GRPOTrainer leaves it to TRL. (A model loaded quantized is refused alike, by its
    `is_quantized`: no quantizer runs on this CPU machine to build one.)"""
    from transformers import BitsAndBytesConfig

    path = tmp_path / "policy"
    tiny_policy(demo_tokenizer).save_pretrained(path)
    kwargs = dict(reward_funcs=digit_reward, train_dataset=make_dataset(8), processing_class=demo_tokenizer)
    four_bit = BitsAndBytesConfig(load_in_4bit=True)
    with pytest.raises(ValueError, match=r"quantization_config \(the trainer's argument\): the policy is quantized "
                       r"\(bitsandbytes\).*Load it in bf16"):  # fmt: skip
        FP8GRPOTrainer(model=str(path), args=tiny_grpo_args(tmp_path), quantization_config=four_bit, **kwargs)
    args = tiny_grpo_args(tmp_path, fp8_training=False, model_init_kwargs={"quantization_config": four_bit})
    with pytest.raises(ValueError, match=r"model_init_kwargs\['quantization_config'\]: the policy is quantized"):
        FP8GRPOTrainer(model=str(path), args=args, **kwargs)
    off = tiny_grpo_args(tmp_path, fp8_training=False, fp8_generation=False)
    check_not_quantized(str(path), four_bit, off)  # nothing of FP8 to refuse it for


def test_fsdp1_is_refused_at_start_and_fsdp2_taken(tmp_path, demo_tokenizer, monkeypatch):
    """FSDP1 (from TrainingArguments or `accelerate launch`'s environment, where it is the default): refused before
    GRPOTrainer builds anything, naming what works instead. FSDP2 (TrainingArguments' default version) is taken; it
    runs in tests/test_fsdp.py."""
    monkeypatch.setattr("trl_fp8.trainers.checks.FSDP2_FLOORS", {})  # (the version floors: the next test)
    kwargs = dict(reward_funcs=digit_reward, train_dataset=make_dataset(8), processing_class=demo_tokenizer)
    fsdp1 = tiny_grpo_args(tmp_path, fsdp=True, fsdp_config={"version": 1})
    with pytest.raises(NotImplementedError, match=r"supports FSDP2, not FSDP1.*fsdp_version: 2.*ZeRO-2.*ZeRO-3"):
        FP8GRPOTrainer(model=tiny_policy(demo_tokenizer), args=fsdp1, **kwargs)
    assert check_fsdp_supported(tiny_grpo_args(tmp_path, fsdp=True)) == 2
    assert check_fsdp_supported(tiny_grpo_args(tmp_path)) is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # `accelerate launch` with an FSDP config, no fsdp_version
    model = tiny_policy(demo_tokenizer)
    with pytest.raises(NotImplementedError, match=r"supports FSDP2, not FSDP1"):
        FP8GRPOTrainer(model=model, args=tiny_grpo_args(tmp_path), **kwargs)
    assert not any(type(m).__name__ == "FP8Linear" for m in model.modules())  # refused before conversion
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert check_fsdp_supported(tiny_grpo_args(tmp_path)) == 2
    # FP8 + LoRA needs a unit per decoder layer: a base linear made a unit of its own would never be gathered.
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP")
    assert check_fsdp_supported(tiny_grpo_args(tmp_path)) == 2
    lora = LoraConfig(target_modules="all-linear", lora_dropout=0.0)
    with pytest.raises(NotImplementedError, match=r"FP8 \+ LoRA under FSDP2 needs.*TRANSFORMER_BASED_WRAP"):
        FP8GRPOTrainer(model=model, args=tiny_grpo_args(tmp_path), peft_config=lora, **kwargs)
    by_size = tiny_grpo_args(tmp_path, fsdp=True, fsdp_config={"min_num_params": 1000})
    with pytest.raises(NotImplementedError, match=r"SIZE_BASED_WRAP / min_num_params"):
        check_fsdp_supported(by_size, lora=True)


def test_fsdp2_is_refused_below_the_versions_it_was_tested_with(tmp_path, monkeypatch):
    """torch < 2.10 or accelerate < 1.15 under FSDP2: refused at start, naming both (torch 2.9's FSDP2 computed other
    gradients than DDP in tests/test_fsdp.py, accelerate 1.14 wrapped other modules). The version lookup is replaced:
    one process cannot hold two torches."""
    from trl_fp8.trainers import checks

    monkeypatch.setattr(checks, "installed_version", {"torch": "2.9.1", "accelerate": "1.14.0"}.get)
    with pytest.raises(NotImplementedError, match=r"torch 2\.9\.1 \(FSDP2 needs >= 2\.10\), accelerate 1\.14\.0 "
                       r"\(FSDP2 needs >= 1\.15\).*ZeRO-2"):  # fmt: skip
        check_fsdp_supported(tiny_grpo_args(tmp_path, fsdp=True))
    assert check_fsdp_supported(tiny_grpo_args(tmp_path)) is None  # no FSDP: nothing to refuse
    monkeypatch.setattr(checks, "installed_version", {"torch": "2.10.0", "accelerate": "1.15.0"}.get)
    assert check_fsdp_supported(tiny_grpo_args(tmp_path, fsdp=True)) == 2


def test_rejects_a_plain_grpo_config(tmp_path, demo_tokenizer):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match=r"replace GRPOConfig\(...\) by FP8GRPOConfig"):
        FP8GRPOTrainer(
            model=tiny_policy(demo_tokenizer),
            reward_funcs=digit_reward,
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
            train_dataset=make_dataset(8),
            processing_class=demo_tokenizer,
        )


def test_a_model_converted_before_is_refused_when_fp8_training_is_off(tmp_path, demo_tokenizer):
    """A second trainer on the model object an earlier one converted (a notebook's rerun) would go on training in FP8
    under `fp8_training=False`: refused, saying what to pass."""
    model = convert_to_fp8(tiny_policy(demo_tokenizer), FP8Recipe())
    with pytest.raises(ValueError, match=r"fp8_training=False, but the model given was already converted to FP8"):
        digit_trainer(tmp_path, demo_tokenizer, model=model, fp8_training=False)
    assert digit_trainer(tmp_path, demo_tokenizer, model=model).fp8_backend == "emulated"  # with it on: as before


def test_a_model_converted_before_is_refused_with_another_recipe_before_peft_wraps_it(tmp_path, demo_tokenizer):
    """Another recipe was refused only by the conversion, after TRL had wrapped the caller's model with LoRA."""
    model = convert_to_fp8(tiny_policy(demo_tokenizer), FP8Recipe())
    with pytest.raises(ValueError, match=r"fp8_recipe: the model given was already converted to FP8 with FP8Recipe"):
        FP8GRPOTrainer(
            model=model, reward_funcs=digit_reward, train_dataset=make_dataset(16), processing_class=demo_tokenizer,
            args=tiny_grpo_args(tmp_path, fp8_recipe=FP8Recipe(pow2_scales=True)),
            peft_config=LoraConfig(r=8, target_modules=["q_proj"], lora_dropout=0.0),
        )  # fmt: skip
    assert not hasattr(model, "peft_config") and type(model.model.layers[0].self_attn.q_proj) is FP8Linear


def test_a_recipe_that_converts_nothing_says_so_from_the_users_line(tmp_path, demo_tokenizer):
    with pytest.warns(UserWarning, match=r"converts none of LlamaForCausalLM's linears") as record:
        trainer = digit_trainer(tmp_path, demo_tokenizer, fp8_recipe=FP8Recipe(modules_to_not_convert=["layers"]))
    # The conversion's warnings name the line that built the trainer, not trl-fp8's own code.
    assert {Path(w.filename).name for w in record if "trl-fp8" in str(w.message)} == {"conftest.py"}
    assert sum("converts none" in str(w.message) for w in record) == 1  # the start-up check does not say it again
    logs = train_and_check(trainer)
    assert trainer.fp8_backend == "none" and "fp8/backend/none" in set().union(*logs)


def test_fp8_sampling_alone_refuses_and_warns_as_end_to_end_fp8_does(tmp_path, demo_tokenizer):
    """With fp8_training=False nothing converts the learner, so the start-up check on the architecture does: a model
    without `layers.{i}` blocks would sample (and save an "FP8" checkpoint) with nothing in FP8."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=128, n_layer=1, n_head=2, n_positions=64))
    gpt2.save_pretrained(tmp_path / "gpt2")
    for model in (gpt2, str(tmp_path / "gpt2")):  # a path: read from its config alone, before TRL loads it
        with pytest.raises(ValueError, match="found no decoder blocks in GPT2LMHeadModel"):
            FP8GRPOTrainer(
                model=model, reward_funcs=digit_reward, args=tiny_grpo_args(tmp_path, fp8_training=False),
                train_dataset=make_dataset(8), processing_class=demo_tokenizer,
            )  # fmt: skip
    narrow = LlamaForCausalLM(
        LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2)
    )  # no linear spans a 128-block
    with pytest.warns(UserWarning, match="nothing will run in FP8") as record:
        FP8GRPOTrainer(
            model=narrow, reward_funcs=digit_reward, args=tiny_grpo_args(tmp_path, fp8_training=False),
            train_dataset=make_dataset(8), processing_class=demo_tokenizer,
        )  # fmt: skip
    assert {Path(w.filename).name for w in record if "trl-fp8" in str(w.message)} == {Path(__file__).name}
