"""An FP8Linear whose state changes after it ran: moved to another device or dtype, given another backend or weight
block size, its weights changed where no version counter sees it (a fused optimizer step, a `.data` write); its
caches must follow, and what cannot be honoured (a create_graph backward, a non-float input, a bad block size,
siblings on different backends) is refused naming the layer."""

import gc
import re

import pytest
import torch
from conftest import (
    MOVES,
    assert_quantizes_its_weight,
    fp8_lora_llama,
    holds_its_own_fp8_weight,
    make_layer,
    tiny_config_kwargs,
    tiny_model,
)
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8
from trl_fp8.quant import FP8Linear, mark_weights_changed, quantize_blockwise
from trl_fp8.quant.staleness import serial


def _attention() -> nn.Module:
    """q, k and v FP8Linears stacked as one sibling group."""
    from trl_fp8.quant.siblings import group_siblings

    torch.manual_seed(0)
    attn = nn.Module()
    for name, out_f in (("q_proj", 256), ("k_proj", 128), ("v_proj", 128)):
        setattr(attn, name, FP8Linear.from_linear(nn.Linear(256, out_f), backend="emulated", name=name))
    assert group_siblings(attn)
    return attn


@pytest.mark.parametrize("move", MOVES)
def test_moving_a_layer_drops_its_fp8_caches(move):
    attn, (_, alone) = _attention(), make_layer()
    x = torch.randn(2, 256)
    with torch.no_grad():
        attn.q_proj(x), alone(torch.randn(2, 384))  # caches filled; k's and v's outputs pending
    MOVES[move](attn), MOVES[move](alone)
    group = attn.q_proj._siblings
    assert alone._w_cache is None and group._cache is None and group._pending is None
    for m in (alone, attn.q_proj, attn.k_proj, attn.v_proj):
        assert_quantizes_its_weight(*m.quantized_weight(), m.weight)
    with torch.no_grad():
        fresh = FP8Linear.from_linear(attn.k_proj.to_linear(), backend="emulated")  # alone, on the moved weight
        assert torch.equal(attn.k_proj(x), fresh(x))


def test_create_graph_is_refused_not_answered_without_a_graph():
    """The FP8 backwards are not differentiable. `once_differentiable` answered `create_graph=True` with a dX without
    a graph and failed only a later `.backward()` through it: `torch.autograd.grad` skipped its error node, and a
    gradient penalty with another path to x (here `sin`) silently lost its FP8 terms."""

    attn, (_, alone) = _attention(), make_layer(in_f=256)
    lora = fp8_lora_llama().base_model.model.model.layers[0].self_attn.q_proj
    assert type(lora).__name__ == "FP8LoraLinear"
    for layer in (alone, attn.q_proj, lora):
        x = torch.randn(3, 256, requires_grad=True)
        loss = layer(x).square().sum() + x.sin().sum()
        with pytest.raises(RuntimeError, match="differentiable once.*create_graph=True"):
            torch.autograd.grad(loss, x, create_graph=True)
        (dx,) = torch.autograd.grad(layer(x).square().sum() + x.sin().sum(), x)  # first order still answers
        assert dx.grad_fn is None and torch.isfinite(dx).all()


def _moe_layer_kinds(model) -> dict[str, list[nn.Module]]:
    from trl_fp8.quant.moe import FP8Experts

    layer = model.model.layers[0]
    attn = layer.self_attn
    assert attn.q_proj._siblings is not None and attn.o_proj._siblings is None
    assert isinstance(layer.mlp.experts, FP8Experts)
    return {
        "alone": [attn.o_proj],
        "siblings": [attn.q_proj, attn.k_proj, attn.v_proj],
        "experts": [layer.mlp.experts],
    }


@pytest.mark.parametrize("kind", ["alone", "siblings", "experts"])
def test_a_backend_set_after_a_forward_is_the_one_that_runs(kind):
    """Setting `backend` was ignored once a forward had resolved one: the layer went on with the old backend."""
    from trl_fp8.demo.tiny_moe import tiny_qwen3_moe

    model = convert_to_fp8(tiny_qwen3_moe(), FP8Recipe(backend="emulated"))
    ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        logits = model(ids).logits
    layers = _moe_layer_kinds(model)[kind]
    for m in layers:
        m.backend = "torch"  # cuBLAS: never on CPU tensors
    with torch.no_grad(), pytest.raises(RuntimeError, match="FP8 backend 'torch'"):
        model(ids)
    for m in layers:
        m.backend = "emulated"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_an_input_that_is_not_floating_point_is_refused_naming_the_layer():
    """Token ids passed where hidden states belong: `nn.Linear` answers with a dtype mismatch naming no layer, and the
    quantizer's error named the tensor 'tensor'."""
    from trl_fp8.demo.tiny_moe import tiny_qwen3_moe

    model = convert_to_fp8(tiny_qwen3_moe(), FP8Recipe(backend="emulated"))
    ids = torch.randint(0, 100, (1, 8, model.config.hidden_size))
    for kind, layers in _moe_layer_kinds(model).items():
        for m in layers:
            name = re.escape(m.fp8_name.removesuffix(".weight"))
            args = (ids, torch.zeros(8, 2, dtype=torch.long), torch.ones(8, 2)) if kind == "experts" else (ids,)
            with pytest.raises(TypeError, match=rf"^{name}: expected a floating-point input tensor, got torch\.int64"):
                m(*args)


def test_a_backend_is_checked_when_set_and_siblings_must_share_theirs():
    from trl_fp8.demo.tiny_moe import tiny_qwen3_moe

    model = convert_to_fp8(tiny_qwen3_moe(), FP8Recipe(backend="emulated"))
    kinds = _moe_layer_kinds(model)
    for m in kinds["alone"] + kinds["experts"]:
        with pytest.raises(
            ValueError, match=r"model\.layers\.0\.(self_attn\.o_proj|mlp\.experts): unknown FP8 backend"
        ):
            m.backend = "fast"
        assert m.backend == "emulated"
    q, k, v = kinds["siblings"]
    ids = torch.randint(0, 100, (1, 8))
    changes = {"backend": "triton", "weight_block_size": (64, 128), "pow2_scales": True}
    for setting, value in changes.items():
        before = getattr(q, setting)
        setattr(q, setting, value)
        shown = repr(value) if setting == "backend" else str(value)
        with (
            torch.no_grad(),
            pytest.raises(ValueError, match=rf"one GEMM(.|\n)*q_proj.weight: .*{setting}={re.escape(shown)}"),
        ):
            model(ids)
        setattr(q, setting, before)
    with torch.no_grad():
        model(ids)


def test_a_weight_block_size_set_after_a_forward_is_the_one_quantized():
    _, layer = make_layer()
    x = torch.randn(3, 384)
    with torch.no_grad():
        layer(x)
    layer.weight_block_size = (64, 128)
    q, s = layer.quantized_weight()
    q_ref, s_ref = quantize_blockwise(layer.weight.detach(), (64, 128))
    assert s.shape == (4, 3) and torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    fresh = FP8Linear.from_linear(layer.to_linear(), backend="emulated", weight_block_size=(64, 128))
    with torch.no_grad():
        assert torch.equal(layer(x), fresh(x))


@pytest.mark.parametrize("block", [(0, 128), (64,), 128, (64.0, 128), (64, 128, 1)])
def test_a_bad_weight_block_size_is_refused_when_set_naming_the_layer(block):
    """It was taken as given and failed at the next quantization, inside a training step."""
    model = convert_to_fp8(
        LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(num_hidden_layers=1))), FP8Recipe(backend="emulated")
    )
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, layer.in_features)
    with torch.no_grad():
        before = layer(x)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj: weight_block_size must be two"):
        layer.weight_block_size = block
    assert layer.weight_block_size == (128, 128)  # unchanged, and the layer runs as before
    with torch.no_grad():
        assert torch.equal(layer(x), before)
    with pytest.raises(ValueError, match="FP8Linear: weight_block_size must be two positive ints"):
        FP8Linear(16, 16, weight_block_size=block)
    with pytest.raises(ValueError, match="FP8Linear: unknown FP8 backend 'fast'"):  # it used to say "weight: "
        FP8Linear(16, 16, backend="fast")


def test_stacked_siblings_requantize_after_a_fused_optimizer_step_and_a_data_write():
    """Stacked q/k/v cache one quantization of their stacked weight. The fused AdamW (transformers' default) updates
    parameters without bumping their version counters, and `.data` writes bypass them: only the process-wide epoch
    (optimizer steps, `mark_weights_changed()`) tells the group's cache that its weights changed, as it tells a lone
    `FP8Linear`'s."""
    model = convert_to_fp8(tiny_model(LlamaConfig, LlamaForCausalLM), FP8Recipe(backend="emulated"))
    attn = model.model.layers[1].self_attn
    assert attn.q_proj._siblings is not None
    params = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
    ids = torch.randint(0, 160, (2, 7))
    model(ids, labels=ids).loss.backward()  # fills the group's cache
    assert all(holds_its_own_fp8_weight(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    versions = [p._version for p in params]
    optimizer.step()
    assert [p._version for p in params] == versions  # the fused step bumps no version counter
    assert all(holds_its_own_fp8_weight(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    attn.k_proj.weight.data.mul_(3)
    mark_weights_changed()
    assert all(holds_its_own_fp8_weight(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj))


def test_a_tensor_taking_a_dead_tensors_id_gets_a_new_serial():
    """`staleness.serial` must never give a new tensor a dead one's number, even where CPython hands the new object
    the dead one's `id()` (as it does at once for an object of the same size): the FP8 caches key on it, and a
    Parameter put in place of a freed one (same id, storage and version) would be served the old FP8 weight."""
    seen = {}
    for _ in range(200):
        t = torch.empty(4)
        key, number = id(t), serial(t)
        if key in seen:
            assert number != seen[key], "a dead tensor's serial was handed to a new tensor with its id"
            return
        seen[key] = number
        del t
        gc.collect()
    pytest.fail("no new tensor took a dead tensor's id in 200 tries: the case this test is for never arose")
