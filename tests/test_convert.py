"""convert_to_fp8 on real tiny transformers models (built in-process)."""

import copy
from pathlib import Path

import pytest
import torch
from conftest import sqnr_db, tiny_config_kwargs, tiny_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8, iter_fp8_state
from trl_fp8.quant import FP8Linear, fp8_modules, quantize_blockwise, select_fp8_linears


PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_qwen2"])
def test_conversion_keeps_state_dict_and_logits(model_name, request):
    model = request.getfixturevalue(model_name)
    ref = copy.deepcopy(model)
    before = dict(model.state_dict())
    convert_to_fp8(model, FP8Recipe(backend="emulated"))

    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in after.items():
        assert v is before[k] or torch.equal(v, before[k]), k
    converted = fp8_modules(model)
    assert len(converted) == 3 * len(PROJ)
    assert all(name.rsplit(".", 1)[-1] in PROJ for name in converted)

    ids = torch.randint(0, 160, (2, 24))
    with torch.no_grad():
        db = sqnr_db(ref(ids).logits, model(ids).logits)
    print(f"{model_name}: logits SQNR FP8 vs fp32 = {db:.1f} dB")
    # ~29 dB per FP8 GEMM (test_linear); 3 layers of 7 GEMMs each compound it. Measured ~21-24 dB.
    assert db > 17


def test_excluded_modules_are_untouched(tiny_llama):
    model = tiny_llama
    kept = {n: m for n, m in model.named_modules() if not isinstance(m, nn.Linear) or "lm_head" in n}
    recipe = FP8Recipe(num_first_layers_in_bf16=1, num_last_layers_in_bf16=1, modules_to_not_convert=["mlp.down_proj"])
    convert_to_fp8(model, recipe)
    assert type(model.lm_head) is nn.Linear
    for name, module in kept.items():
        assert model.get_submodule(name) is module if name else True
    expected = [f"model.layers.1.self_attn.{p}" for p in PROJ[:4]] + [
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    ]
    assert sorted(fp8_modules(model)) == sorted(expected)
    assert model.fp8_recipe == recipe  # a copy: changing `recipe` now changes neither the model nor what it says


def test_the_stream_of_an_unconverted_model_takes_the_recipe_as_convert_to_fp8_does(tiny_llama):
    """`iter_fp8_state(model, recipe)` quantizes what the recipe selects on a model nobody converted (the BF16
    learner of FP8 generation alone); the recipe may be a dict, as for `convert_to_fp8`."""
    fields = {"modules_to_not_convert": ["mlp.down_proj"], "num_first_layers_in_bf16": 1}
    from_dict, from_recipe = iter_fp8_state(tiny_llama, fields), iter_fp8_state(tiny_llama, FP8Recipe(**fields))
    for (name, a), (name_b, b) in zip(from_dict, from_recipe, strict=True):
        assert name == name_b and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    fp8 = {n for n, t in iter_fp8_state(tiny_llama, fields) if t.dtype == torch.float8_e4m3fn}
    expected = {f"model.layers.{i}.{kind}.{p}.weight" for i in (1, 2) for kind, p in (
        *(("self_attn", p) for p in PROJ[:4]), ("mlp", "gate_proj"), ("mlp", "up_proj"))}  # fmt: skip
    assert fp8 == expected


def test_misaligned_layers_stay_high_precision_with_one_warning():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(intermediate_size=320)))
    with pytest.warns(
        UserWarning,
        match=r"9 layer\(s\).*stay in high precision.*model.layers.0.mlp.gate_proj \(320x256, not in whole 128x128 blocks\)",
    ) as record:
        convert_to_fp8(model)
    assert len([w for w in record if "trl-fp8" in str(w.message)]) == 1
    assert not any(isinstance(m, FP8Linear) for n, m in model.named_modules() if "mlp" in n)
    assert len(fp8_modules(model)) == 3 * 4


def test_glob_patterns_and_linear_routers_stay_in_high_precision(tiny_llama):
    selected, _ = select_fp8_linears(tiny_llama, FP8Recipe(modules_to_not_convert=["mlp.*"]))
    assert selected and not any(".mlp." in name for name in selected)
    # A plain pattern matches whole dotted components anywhere in the name: "layers.1" keeps all of layer 1.
    selected, _ = select_fp8_linears(tiny_llama, FP8Recipe(modules_to_not_convert=["layers.1"]))
    assert selected and not any(".layers.1." in name for name in selected)
    assert any(".layers.0." in name for name in selected) and not any(".layers.10" in name for name in selected)
    tiny_llama.model.layers[0].mlp.gate = nn.Linear(256, 128, bias=False)  # a router that is a plain nn.Linear
    assert "model.layers.0.mlp.gate" not in select_fp8_linears(tiny_llama, FP8Recipe())[0]


def test_a_recipe_that_keeps_nothing_or_converts_nothing_says_so(tiny_llama):
    with pytest.warns(UserWarning, match=r"modules_to_not_convert \['mlp.dwon_proj'\] match no module.*misspelt"):
        convert_to_fp8(copy.deepcopy(tiny_llama), FP8Recipe(modules_to_not_convert=["mlp.dwon_proj", "down_proj"]))
    with pytest.warns(
        UserWarning, match=r"converts none of LlamaForCausalLM's linears.*num_first_layers_in_bf16=5"
    ) as rec:
        convert_to_fp8(copy.deepcopy(tiny_llama), FP8Recipe(num_first_layers_in_bf16=5))
    assert {Path(w.filename).name for w in rec} == {Path(__file__).name}  # the caller's line, not trl-fp8's


def test_training_step_changes_every_parameter(tiny_qwen2):
    model = convert_to_fp8(tiny_qwen2.train(), FP8Recipe())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 160, (4, 16))
    loss = model(ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    opt.step()
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), f"parameter {n} did not change"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"weight_block_size": [64, 64], "backend": "torch"}, "weight_block_size"),
        ({"weight_block_size": [128]}, "weight_block_size"),
        ({"activation_block_size": [128, 128]}, "activation_block_size"),
        ({"backend": "cuda"}, "backend"),
        ({"num_first_layers_in_bf16": -1}, "num_first_layers_in_bf16"),
        ({"num_last_layers_in_bf16": 1.5}, "num_last_layers_in_bf16"),
        ({"pow2_scales": "yes"}, "pow2_scales"),
        ({"modules_to_not_convert": [""]}, "modules_to_not_convert"),
        # From YAML or the command line, a string would otherwise be split into characters that match nothing.
        ({"modules_to_not_convert": "mlp.down_proj"}, "modules_to_not_convert must be a list, got str"),
        ({"weight_block_size": "128"}, "weight_block_size must be a list"),
        ({"weight_block_size": None}, "weight_block_size must be a list, got NoneType"),
        ({"activation_block_size": None}, "activation_block_size must be a list, got NoneType"),
        ({"weight_block_size": [True, 128]}, "weight_block_size must be two positive ints"),
        ({"weight_block_size": [0, 128], "backend": "emulated"}, "weight_block_size must be two positive ints"),
        ({"weight_block_size": [64, 64], "backend": "te"}, "weight_block_size"),
        ({"num_first_layers_in_bf16": True}, "num_first_layers_in_bf16"),
    ],
)
def test_invalid_recipe_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"FP8Recipe.{field}"):
        FP8Recipe(**kwargs)


def test_recipe_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown FP8Recipe fields \['block'\]"):
        FP8Recipe.from_any({"block": 64})
    assert FP8Recipe.from_any({"pow2_scales": True}).pow2_scales
    with pytest.raises(ValueError, match=r"expected an FP8Recipe, a dict .* got list \[128, 128\]"):
        FP8Recipe.from_any([128, 128])


def test_multimodal_models_convert_their_text_decoder_only():
    """Gemma 3 (4B and up) loads as Gemma3ForConditionalGeneration, whose vision tower also has `layers.{i}`: only
    the text decoder (transformers' `get_decoder()`) is converted, and `num_last_layers_in_bf16` counts its blocks."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(tiny_config_kwargs(num_hidden_layers=3), sliding_window=16)
    vision = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, image_size=32)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(
        Gemma3Config(text_config=text, vision_config=dict(vision, patch_size=8), mm_tokens_per_image=4)
    )
    convert_to_fp8(model, FP8Recipe(num_last_layers_in_bf16=1))
    converted = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert converted and all(n.startswith("model.language_model.layers.") for n in converted)
    assert {n.split(".")[3] for n in converted} == {"0", "1"}  # the text model's last block stays in BF16


def test_a_model_without_layer_blocks_is_refused_and_untouched():
    """GPT-2-style blocks (`transformer.h.{i}`) would convert nothing and train in BF16 while claiming FP8."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    model = GPTBigCodeForCausalLM(GPTBigCodeConfig(vocab_size=160, n_embd=256, n_layer=2, n_head=4, n_inner=512))
    with pytest.raises(ValueError, match=r"found no decoder blocks in GPTBigCodeForCausalLM.*`h.\{i\}`"):
        convert_to_fp8(model)
    assert not hasattr(model, "fp8_recipe")


def test_converting_again_needs_the_same_recipe():
    model = convert_to_fp8(LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs())), FP8Recipe())
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert convert_to_fp8(model, FP8Recipe()) is model  # a no-op
    assert [m for m in model.modules() if isinstance(m, FP8Linear)] == layers
    with pytest.raises(
        ValueError, match=r"already converted with FP8Recipe\(.*pow2_scales=False.*convert the original"
    ):
        convert_to_fp8(model, FP8Recipe(pow2_scales=True))
    assert model.fp8_recipe == FP8Recipe() and all(not m.pow2_scales for m in layers)


def test_the_stream_of_an_unconverted_model_takes_the_recipes_pow2_scales():
    """With FP8 sampling alone the learner stays in high precision, and `iter_fp8_state` quantizes it for the sampler
    by the recipe: pow2 scales when it says so (vLLM then runs them as E8M0)."""
    model = tiny_model(LlamaConfig, LlamaForCausalLM)
    params = dict(model.named_parameters())
    pairs = dict(iter_fp8_state(model, FP8Recipe(pow2_scales=True)))
    fp8 = [n for n, t in pairs.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 3 * 7
    for name in fp8:
        q_ref, s_ref = quantize_blockwise(params[name].detach(), (128, 128), pow2_scales=True)
        assert torch.equal(pairs[name].view(torch.uint8), q_ref.view(torch.uint8)), name
        assert torch.equal(pairs[f"{name}_scale_inv"], s_ref), name
        assert torch.all(torch.frexp(s_ref).mantissa == 0.5), name


def test_non_square_weight_blocks_are_checked_against_out_and_in_features():
    """A linear converts when its (out, in) features are whole (block rows, block cols): with 64x128 blocks and an
    intermediate size of 192, gate/up (192x256) do and down (256x192) does not."""
    model = tiny_model(LlamaConfig, LlamaForCausalLM, intermediate_size=192)
    with pytest.warns(UserWarning, match=r"model.layers.0.mlp.down_proj \(256x192, not in whole 64x128 blocks\)"):
        convert_to_fp8(model, FP8Recipe(weight_block_size=[64, 128]))
    mlp = model.model.layers[1].mlp
    assert isinstance(mlp.gate_proj, FP8Linear) and isinstance(mlp.up_proj, FP8Linear)
    assert type(mlp.down_proj) is nn.Linear
