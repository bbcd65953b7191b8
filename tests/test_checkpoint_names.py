"""vLLM and the FP8 checkpoint get the stream under the names a Hub checkpoint gives its tensors: what
`save_pretrained` writes, not transformers' runtime names (Mixtral's `block_sparse_moe.experts.{e}.w1` is
`mlp.experts.gate_up_proj` at run time, GPT-NeoX's `embed_out` is `lm_head`). The oracle is `save_pretrained` itself,
for every family of `trl_fp8.demo.families`."""

import json

import pytest
import torch
from conftest import families, tiny_grpo_args
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trl_fp8 import FP8GRPOTrainer, FP8Recipe, convert_to_fp8, iter_fp8_state, quantize_blockwise
from trl_fp8.demo.families import FAMILIES, LAYERS_ONLY, tiny, varied_reward
from trl_fp8.demo.task import make_dataset
from trl_fp8.generation.vllm_fp8 import fp8_llm_kwargs
from trl_fp8.quant import dequantize_blockwise, fp8_modules
from trl_fp8.quant.export import save_fp8_checkpoint, stream_checkpoint_names
from trl_fp8.quant.moe import FP8Experts


# HY-V4's checkpoints hold its experts fused: they cannot travel per expert in FP8 (next test).
ALL = [f for f in (*FAMILIES, *LAYERS_ONLY) if f != "hy_v4"]


def assert_is_checkpoint(stream: dict, saved: dict) -> None:
    """`stream` holds `saved`'s tensors under its names: high-precision ones equal, FP8 ones as the recipe quantizes
    the checkpoint's tensor, bit for bit."""
    fp8 = {n for n, t in stream.items() if t.dtype == torch.float8_e4m3fn}
    assert set(stream) == set(saved) | {f"{n}_scale_inv" for n in fp8}
    for name, tensor in saved.items():
        if name in fp8:
            codes, scale_inv = quantize_blockwise(tensor, (128, 128))
            assert torch.equal(stream[name].view(torch.uint8), codes.view(torch.uint8)), name
            assert torch.equal(stream[f"{name}_scale_inv"], scale_inv), name
        else:
            assert torch.equal(stream[name], tensor), name


@pytest.mark.parametrize("family", families(*ALL))
def test_the_stream_vllm_loads_is_what_save_pretrained_writes(tmp_path, family):
    model = tiny(family)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    recipe = FP8Recipe()
    convert_to_fp8(model, recipe)
    assert fp8_modules(model)
    stream = dict(stream_checkpoint_names(model, recipe, [])(list(iter_fp8_state(model))))
    assert_is_checkpoint(stream, saved)


@pytest.mark.parametrize("family", families("mixtral", "olmoe", "llama4"))
def test_high_precision_experts_travel_as_views_of_the_learners_fused_tensors(tmp_path, family):
    """Experts kept in high precision travel per expert where the checkpoint holds them so (Mixtral, OLMoE), fused
    where it holds them fused (Llama 4), and in both cases as views of the learner's tensors: a sync copies nothing."""
    model = tiny(family)
    model.save_pretrained(tmp_path)
    recipe = FP8Recipe(modules_to_not_convert=["experts"])
    convert_to_fp8(model, recipe)
    pairs = list(iter_fp8_state(model))
    stream = stream_checkpoint_names(model, recipe)(pairs)
    assert_is_checkpoint(dict(stream), load_file(tmp_path / "model.safetensors"))
    fused = {p.untyped_storage().data_ptr() for n, p in model.named_parameters() if ".experts." in n}
    experts = [t for n, t in stream if ".experts." in n]
    per_layer = 2 if family == "llama4" else 3 * 4  # fused gate_up and down, or gate, up and down of 4 experts
    assert len(experts) == per_layer * model.config.num_hidden_layers
    assert all(t.untyped_storage().data_ptr() in fused for t in experts)


@pytest.mark.parametrize("family", families("hy_v4"))
def test_fp8_weights_a_checkpoint_holds_in_another_layout_are_refused_naming_them(tmp_path, demo_tokenizer, family):
    """HY-V4's checkpoints hold each layer's experts as one fused tensor, where trl-fp8 sends FP8 experts one by one
    (their 128x128 blocks): refused before anything is sent or trained, naming the pattern that keeps them in high
    precision, which then works."""
    model = tiny(family)
    model.save_pretrained(tmp_path)
    convert_to_fp8(model, FP8Recipe())
    with pytest.raises(
        ValueError,
        match=r"HYV4ForCausalLM's checkpoints hold model.layers.1.mlp.experts.0.down_proj.weight \(and 11 more\) in "
        r"another layout.*modules_to_not_convert=\['mlp.experts'\]",
    ):
        stream_checkpoint_names(model, FP8Recipe(), [])
    # A run that would save an FP8 checkpoint is refused when the trainer is built, not when it ends.
    with pytest.raises(ValueError, match=r"another layout.*modules_to_not_convert=\['mlp.experts'\]"):
        FP8GRPOTrainer(
            model=tiny(family),
            reward_funcs=varied_reward,
            args=tiny_grpo_args(tmp_path, fp8_save_format="fp8"),
            train_dataset=make_dataset(8),
            processing_class=demo_tokenizer,
        )
    recipe = FP8Recipe(modules_to_not_convert=["mlp.experts"])
    model = convert_to_fp8(tiny(family), recipe)
    assert not any(isinstance(m, FP8Experts) for m in model.modules())
    stream = dict(stream_checkpoint_names(model, recipe, [])(list(iter_fp8_state(model))))
    assert_is_checkpoint(stream, load_file(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("family", families("mixtral", "gpt_neox"))
def test_fp8_checkpoint_of_a_renamed_family_loads_in_transformers_and_names_vllms_modules(tmp_path, family):
    """Mixtral's and GPT-NeoX's checkpoints name tensors otherwise than transformers does at run time: the FP8
    checkpoint loads back with no tensor missing or unexpected, every FP8 weight as the learner holds it, and what
    stays in high precision is listed in transformers' names for transformers and the checkpoint's for vLLM."""
    model = convert_to_fp8(tiny(family), FP8Recipe())
    save_fp8_checkpoint(model, str(tmp_path), FP8Recipe())
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name, module in fp8_modules(model).items():
        if isinstance(module, FP8Experts):
            got, fused = loaded.get_submodule(name).gate_up_proj, module.quantized("gate_up_proj")
        else:
            got, fused = loaded.get_submodule(name).weight, module.quantized_weight()
        assert torch.equal(got, dequantize_blockwise(*fused).to(got.dtype)), name
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    vllm_kwargs = fp8_llm_kwargs(tiny(family), FP8Recipe())
    if family == "mixtral":
        routers = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
        assert config["modules_to_not_convert"] == [*routers, "lm_head"]
        vllm_routers = [r.replace(".mlp.", ".block_sparse_moe.") for r in routers]
        assert config["ignored_layers"] == [*vllm_routers, "lm_head"]
        assert vllm_kwargs["hf_overrides"]["quantization_config"]["ignored_layers"] == vllm_routers
    else:
        assert config["modules_to_not_convert"] == ["lm_head"] and config["ignored_layers"] == ["embed_out"]
