"""vLLM and the FP8 checkpoint get the stream under the names a Hub checkpoint gives its tensors: what
`save_pretrained` writes, not transformers' runtime names (Mixtral's `block_sparse_moe.experts.{e}.w1` is
`mlp.experts.gate_up_proj` at run time, GPT-NeoX's `embed_out` is `lm_head`). The oracle is `save_pretrained` itself,
for every family of `trl_fp8.demo.families`."""

import json

import pytest
import torch
from conftest import families, tiny_grpo_args
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from trl_fp8 import FP8GRPOTrainer, FP8Recipe, convert_to_fp8, iter_fp8_state, quantize_blockwise
from trl_fp8.demo.families import FAMILIES, LAYERS_ONLY, tiny, varied_reward
from trl_fp8.demo.task import make_dataset
from trl_fp8.generation.vllm_fp8 import fp8_llm_kwargs
from trl_fp8.quant import dequantize_blockwise, fp8_modules
from trl_fp8.quant.export import stream_checkpoint_names
from trl_fp8.quant.fp8_checkpoint import save_fp8_checkpoint
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
            model=(user_model := tiny(family)),
            reward_funcs=varied_reward,
            args=tiny_grpo_args(tmp_path, fp8_save_format="fp8"),
            train_dataset=make_dataset(8),
            processing_class=demo_tokenizer,
        )
    assert not fp8_modules(user_model)  # refused before conversion
    recipe = FP8Recipe(modules_to_not_convert=["mlp.experts"])
    model = convert_to_fp8(tiny(family), recipe)
    assert not any(isinstance(m, FP8Experts) for m in model.modules())
    names = stream_checkpoint_names(model, recipe, [])
    assert_is_checkpoint(dict(names(list(iter_fp8_state(model)))), load_file(tmp_path / "model.safetensors"))
    # Kept in high precision, the fused experts keep their name: renamed in place, not reverted at every sync.
    assert names.renames["model.layers.1.mlp.experts.gate_up_proj"] == "model.layers.1.mlp.experts.gate_up_proj"


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


def _reverse_rows():
    """A conversion op reversing a weight's rows, which runs on a tag of any size (one row included)."""
    from transformers.core_model_loading import ConversionOps

    class ReverseRows(ConversionOps):
        def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
            tensor = next(iter(input_dict.values()))
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            return {target_patterns[0]: tensor.flip(0).contiguous()}

        @property
        def reverse_op(self) -> ConversionOps:
            return ReverseRows()

    return ReverseRows()


def test_a_conversion_that_moves_a_weights_rows_is_refused_whether_or_not_it_runs_on_the_stand_ins(tiny_llama):
    """An FP8 weight whose rows a checkpoint holds in another order cannot be renamed: its 128x128 blocks would hold
    other values. Here transformers' own operations stand in for such a checkpoint format: an interleave (which runs
    on the stand-in tags, and reorders them) and a RoPE permutation (which fails on them); and a reversal of the rows,
    which runs on any tag and shows only on tags of several rows."""
    from transformers.core_model_loading import Interleave, PermuteForRope, WeightConverter

    model = convert_to_fp8(tiny_llama, FP8Recipe())
    model._weight_conversions = [
        WeightConverter("mlp.gate_proj.weight", "mlp.gate_proj.weight", [Interleave(dim=0)]),
        WeightConverter("self_attn.q_proj.weight", "self_attn.q_proj.weight", [PermuteForRope()]),
    ]
    layers = model.config.num_hidden_layers
    with pytest.raises(ValueError, match=rf"hold model.layers.0.mlp.gate_proj.weight \(and {2 * layers - 1} more\)"):
        stream_checkpoint_names(model, FP8Recipe())
    model._weight_conversions = model._weight_conversions[1:]
    with pytest.raises(ValueError, match=rf"hold model.layers.0.self_attn.q_proj.weight \(and {layers - 1} more\)"):
        stream_checkpoint_names(model, FP8Recipe())
    model._weight_conversions = [WeightConverter("mlp.up_proj.weight", "mlp.up_proj.weight", [_reverse_rows()])]
    with pytest.raises(ValueError, match=rf"hold model.layers.0.mlp.up_proj.weight \(and {layers - 1} more\)"):
        stream_checkpoint_names(model, FP8Recipe())


@pytest.mark.parametrize("family", families("qwen3_5"))
def test_a_text_model_loaded_from_under_a_multimodal_prefix_syncs_without_it(tmp_path, family):
    """A Qwen3.5 text model loaded from weights under `model.language_model.` (a multimodal checkpoint's layout):
    `save_pretrained`, and the FP8 checkpoint, put the prefix back; vLLM's text model loads its tensors without it
    (vLLM 0.22 has no mapping for the prefix), so the sync stream and vLLM's `ignored_layers` leave it off."""
    tiny(family).save_pretrained(tmp_path / "text")
    prefixed = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
        for k, v in load_file(tmp_path / "text" / "model.safetensors").items()
    }
    save_file(prefixed, tmp_path / "text" / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32)
    recipe = FP8Recipe()
    ignored = fp8_llm_kwargs(model, recipe)["hf_overrides"]["quantization_config"]["ignored_layers"]
    assert ignored and not [n for n in ignored if "language_model" in n]
    convert_to_fp8(model, recipe)
    pairs = list(iter_fp8_state(model))
    stream = stream_checkpoint_names(model, recipe, prefixes=False)(pairs)
    assert [n for n, _ in stream] == [n for n, _ in pairs]  # no other renames in Qwen3.5
    saved = save_fp8_checkpoint(model, str(tmp_path / "fp8"), recipe)
    assert saved and all(n.startswith("model.language_model.layers.") for n in saved)
