"""FP8 + LoRA numerics: an `FP8LoraLinear` is, bit for bit, an `FP8Linear` holding the merged weight W + s·B·A, and
its adapters receive that linear's FP8 weight gradient through the merge. On a real tiny Llama wrapped by PEFT."""

import pytest
import torch
from conftest import (
    LORA_TARGETS,
    MOVES,
    assert_quantizes_its_weight,
    fp8_lora_llama,
    lora_llama,
    sqnr_db,
)
from peft import LoraConfig
from torch import nn

from trl_fp8 import FP8Recipe, convert_to_fp8
from trl_fp8.quant import FP8Linear, quantize_blockwise
from trl_fp8.quant.adapters import merged_weight
from trl_fp8.quant.lora import FP8LoraLinear, convert_lora_layers


def merged_fp8_linear(layer: FP8LoraLinear) -> FP8Linear:
    """The reference: a plain FP8Linear whose (leaf) weight is the merged one."""
    base = layer.get_base_layer()
    plain = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
    plain.weight = nn.Parameter(merged_weight(layer).detach().clone())
    return FP8Linear.from_linear(plain, weight_block_size=base.weight_block_size)


# 64x128: dgrad reads the merged weight's blocks transposed, which only a non-square block tells apart.
@pytest.mark.parametrize("block", [(128, 128), (64, 128)], ids=["w128x128", "w64x128"])
def test_forward_and_dgrad_are_an_fp8_linear_holding_the_merged_weight_and_the_adapters_train_as_in_peft(block):
    model = fp8_lora_llama(recipe=FP8Recipe(weight_block_size=list(block)))
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    assert isinstance(layer, FP8LoraLinear) and layer.get_base_layer().weight_block_size == block
    reference = merged_fp8_linear(layer)
    x = torch.randn(2, 5, 512, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = layer(x), reference(x_ref)
    assert torch.equal(y, y_ref)  # the same quantizations, the same GEMM
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad)  # dgrad on Q(W + s·B·A)
    # The adapters' gradients are the high-precision ones of x·(W + s·B·A)ᵀ (straight through the quantization), as
    # PEFT computes them, without an FP8 weight gradient.
    s = layer.scaling["default"]
    lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    a, b = lora_a.detach().clone().requires_grad_(True), lora_b.detach().clone().requires_grad_(True)
    w = layer.get_base_layer().weight.detach()
    (x.detach() @ (w + s * b @ a).T).backward(dy)
    # (The same sums in another order: fp32 rounding, > 100 dB.)
    assert sqnr_db(a.grad, lora_a.grad) > 100 and sqnr_db(b.grad, lora_b.grad) > 100
    assert layer.get_base_layer().weight.grad is None  # W is frozen


def test_the_sampler_gets_the_quantization_the_layer_computed_with():
    model = fp8_lora_llama(r=4, use_rslora=True)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    layer(torch.randn(3, 256))
    q, s = layer.quantized_weight()
    q_ref, s_ref = quantize_blockwise(merged_weight(layer).detach(), (128, 128))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert layer.quantized_weight()[0] is q  # cached until the weights change
    # An optimizer step on the adapters re-makes it.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, fused=False)
    layer(torch.randn(3, 256)).sum().backward()
    optimizer.step()
    q2, _ = layer.quantized_weight()
    q2_ref, _ = quantize_blockwise(merged_weight(layer).detach(), (128, 128))
    assert q2 is not q and torch.equal(q2.view(torch.uint8), q2_ref.view(torch.uint8))
    assert not torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_the_merged_fp8_weight_follows_set_scale():
    """PEFT's `set_scale` changes s in Q(W + s·B·A) without touching a parameter: the cached merged FP8 weight (which
    the forward and the sampler read) must follow it."""
    layer = fp8_lora_llama().base_model.model.model.layers[1].mlp.down_proj
    layer.quantized_weight()
    layer.set_scale("default", 3.0)
    q, s = layer.quantized_weight()
    q_ref, s_ref = quantize_blockwise(merged_weight(layer).detach(), (128, 128))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_disabled_or_merged_adapters_run_the_fp8_base_layer():
    model = fp8_lora_llama()
    layer = model.base_model.model.model.layers[2].self_attn.v_proj
    base = layer.get_base_layer()
    x = torch.randn(4, 256)
    with torch.no_grad():
        with model.disable_adapter():  # TRL's reference log-probs with PEFT
            assert torch.equal(layer(x), base(x))
        lora_out = layer(x)
        assert not torch.equal(lora_out, base(x))
        # PEFT merges through `weight.data`, unseen by version counters: the base's FP8 cache must still follow.
        base(x)
        model.merge_adapter()
        merged = layer(x)
        model.unmerge_adapter()
        assert torch.equal(layer(x), lora_out)
    assert torch.equal(merged, lora_out)  # Q(W + s·B·A) either way


def test_a_trainable_base_weight_is_refused_not_left_without_a_gradient():
    """PEFT's LoRA layer over an `nn.Linear` gives an unfrozen base weight its gradient; the FP8 LoRA layer computes
    none (no N x K wgrad), so training it would silently leave it unchanged: refused, naming the layer."""
    model = fp8_lora_llama()
    layer = model.base_model.model.model.layers[2].self_attn.v_proj
    layer.get_base_layer().weight.requires_grad_(True)
    x = torch.randn(4, 256)
    with pytest.raises(RuntimeError, match=r"model\.layers\.2\.self_attn\.v_proj: its base weight is trainable"):
        layer(x)
    with torch.no_grad():  # no gradient asked for: nothing is lost
        assert layer(x).shape == (4, layer.out_features)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (dict(lora_dropout=0.1), r"layers.0.self_attn.q_proj: LoraConfig.lora_dropout must be 0 for FP8 \+ LoRA"),
        (dict(use_dora=True), r"layers.0.self_attn.q_proj: LoRA variant DoraLinearVariant"),
        (dict(lora_bias=True), r"layers.0.self_attn.q_proj: LoraConfig.lora_bias is not supported"),
    ],
    ids=["dropout", "dora", "lora_bias"],
)
def test_adapters_that_cannot_be_merged_are_refused_before_anything_changes(lora, message):
    model = convert_to_fp8(lora_llama(**lora), FP8Recipe())
    with pytest.raises(ValueError, match=message):
        convert_lora_layers(model)
    assert not any(isinstance(m, FP8LoraLinear) for m in model.modules())


def test_the_fp8_weight_is_that_of_peft_s_own_merge_in_bf16():
    """Over a bf16 base PEFT keeps the adapters in fp32, and its merge (`merge_and_unload()`, `merge_adapter()`) adds
    the fp32 delta and rounds once to bf16: the FP8 layer quantizes that same weight, so a policy merged after FP8 +
    LoRA training quantizes onto the grid it trained and sampled on. (Rounding the delta to bf16 before adding, as
    PEFT's `safe_merge=True` does, moved about a fifth of the merged weights and 2-3% of the FP8 codes.)"""
    model = fp8_lora_llama(torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, FP8LoraLinear)]
    assert layers[0].lora_A["default"].weight.dtype == torch.float32
    held = [layer.quantized_weight() for layer in layers]
    model.merge_adapter()
    for layer, (q, s) in zip(layers, held, strict=True):
        q_ref, s_ref = quantize_blockwise(layer.get_base_layer().weight.detach(), (128, 128))
        assert layer.get_base_layer().weight.dtype == torch.bfloat16
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_several_active_adapters_merge_into_one_fp8_weight():
    model = fp8_lora_llama()
    model.add_adapter("other", LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS, lora_dropout=0.0))
    convert_lora_layers(model)  # the new adapter's layers are the same (already re-classed) modules
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    nn.init.normal_(layer.lora_B["other"].weight, std=0.05)
    model.base_model.set_adapter(["default", "other"])
    expected = layer.get_base_layer().weight + layer.get_delta_weight("default") + layer.get_delta_weight("other")
    torch.testing.assert_close(merged_weight(layer), expected, rtol=0, atol=0)
    x = torch.randn(3, 256)
    with torch.no_grad():
        both = layer(x)
        assert torch.equal(both, merged_fp8_linear(layer)(x))
        model.base_model.set_adapter("default")  # the cache follows the active adapters
        one = layer(x)
        assert torch.equal(one, merged_fp8_linear(layer)(x)) and not torch.equal(one, both)


def test_adapted_layers_stay_fp8_linears_where_transformer_engine_takes_the_others(monkeypatch):
    """TransformerEngine cannot run here (no CUDA): a stand-in for its linear class records which layers it is
    given. Those LoRA adapts must stay `FP8Linear`, whose GEMMs `FP8LoraLinear` drives with the merged weight."""
    import trl_fp8.quant.convert as convert

    taken = []

    class TransformerEngineStandIn:
        @staticmethod
        def from_linear(linear, pow2_scales, name, device=None):
            taken.append(name)
            return linear

    monkeypatch.setattr(convert, "_te_linear_for", lambda model, recipe, sharded, device: TransformerEngineStandIn)
    model = lora_llama()
    base = model.get_base_model()
    convert_to_fp8(base, FP8Recipe(backend="te"))
    assert sorted({name.rsplit(".", 1)[1] for name in taken}) == ["gate_proj", "k_proj", "o_proj", "up_proj"]
    adapted = [m for m in base.modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 3 * len(LORA_TARGETS)
    assert all(isinstance(m.get_base_layer(), FP8Linear) and m.get_base_layer().backend == "auto" for m in adapted)
    assert len(convert_lora_layers(base)) == len(adapted)


def test_adapters_added_after_conversion_are_not_streamed_without_their_fp8_layer():
    """An adapter added after `convert_lora_layers` runs PEFT's additive forward over the FP8 base: no FP8 weight
    reproduces it, so the stream refuses the layer instead of sending the base weight without its adapter."""
    from trl_fp8.quant import iter_fp8_state

    model = fp8_lora_llama()
    model.add_adapter("other", LoraConfig(target_modules=["k_proj"], lora_dropout=0.0))
    model.base_model.set_adapter(["default", "other"])
    with pytest.raises(ValueError, match=r"layers.0.self_attn.k_proj: its LoRA adapters run PEFT's additive forward"):
        list(iter_fp8_state(model.get_base_model()))
    convert_lora_layers(model.get_base_model())
    assert len(list(iter_fp8_state(model.get_base_model()))) > 0


@pytest.mark.parametrize(
    "lora,message",
    [(dict(lora_dropout=0.5), r"lora_dropout must be 0"), (dict(use_dora=True), r"LoRA variant DoraLinearVariant")],
    ids=["dropout", "dora"],
)
def test_an_adapter_added_to_an_fp8_layer_after_conversion_is_checked_too(lora, message):
    """PEFT's `add_adapter` puts a new adapter into the converted layer itself: its dropout or variant, which the
    merged weight cannot carry, is refused at the first forward or export that activates it, naming both."""
    from trl_fp8.quant import iter_fp8_state

    model = fp8_lora_llama()
    model.add_adapter("other", LoraConfig(r=4, target_modules=["q_proj"], **lora))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, FP8LoraLinear)
    x = torch.randn(3, 256)
    layer(x)  # an inactive adapter does not matter
    model.base_model.set_adapter(["default", "other"])
    pattern = rf"model.layers.0.self_attn.q_proj: .*{message}.*'other'"
    with pytest.raises(ValueError, match=pattern):
        layer(x)
    with pytest.raises(ValueError, match=pattern):
        list(iter_fp8_state(model.get_base_model()))


@pytest.mark.parametrize("moved", ["layer", "base_layer"])
@pytest.mark.parametrize("move", ["half_float", "same_address"])
def test_moving_an_fp8_lora_layer_drops_its_merged_weight(move, moved):
    """Moving the LoRA layer, or its FP8 base alone (which the LoRA layer's own `_apply` never sees)."""

    model = fp8_lora_llama()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer(torch.randn(2, 256))
    MOVES[move](layer if moved == "layer" else layer.base_layer)
    if moved == "layer":
        assert layer._fp8_cache is None
    assert_quantizes_its_weight(*layer.quantized_weight(), merged_weight(layer))


def test_an_adapted_layers_output_may_be_clamped_in_place_as_olmo_does():
    """OLMo 1.7's `clip_qkv` clamps q, k and v with `clamp_`, which autograd forbids on a view a custom Function made
    (the adapted layer's output was one); the gradients are those of clamping out of place, bit for bit."""
    layer = fp8_lora_llama().base_model.model.model.layers[0].self_attn.q_proj
    x0 = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(0))
    dy = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(1))
    params = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]

    def run(in_place: bool):
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_(True)
        y = layer(x)
        y = y.clamp_(-0.5, 0.5) if in_place else y.clamp(-0.5, 0.5)
        y.backward(dy)
        return y, x.grad, [p.grad for p in params]

    y, dx, grads = run(in_place=True)
    y_ref, dx_ref, grads_ref = run(in_place=False)
    assert 0.1 < (y.abs() == 0.5).float().mean() < 0.9  # the clamp decides part of every gradient
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    assert all(torch.equal(g, r) for g, r in zip(grads, grads_ref, strict=True))
