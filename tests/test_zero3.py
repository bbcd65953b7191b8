"""DeepSpeed ZeRO-3's contracts with the FP8 modules and the export stream, in one process (and FSDP2's, where they
are the same). ZeRO-3 itself runs in
tests/test_distributed.py (two processes, against DDP); here its partitioning is stood in for the way DeepSpeed marks
and empties a parameter: a `ds_id` attribute, `ds_shape`, and an empty tensor outside a gather (one process cannot
shard anything)."""

from contextlib import contextmanager

import pytest
import torch
from conftest import fp8_lora_llama, tiny_policy

from trl_fp8 import FP8Recipe, convert_to_fp8, iter_fp8_state
from trl_fp8.demo.make_model import build_tokenizer
from trl_fp8.demo.tiny_moe import tiny_qwen3_moe
from trl_fp8.generation.vllm_layout import check_vllm_fp8_layers
from trl_fp8.quant import FP8Linear
from trl_fp8.quant.convert import mark_sharded
from trl_fp8.quant.export import iter_hp_state
from trl_fp8.quant.linear import full_shape
from trl_fp8.quant.moe import FP8Experts
from trl_fp8.trainers.checks import check_backend_runs_here


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _shard(params) -> dict:
    """Empties `params` as ZeRO-3 does outside a gather; returns their whole data, by parameter."""
    whole = {}
    for p in params:
        whole[p] = p.data
        p.ds_id, p.ds_shape = len(whole), p.shape
        p.data = torch.empty(0, dtype=p.dtype)
    return whole


def _emulated_gather(whole: dict, log: list):
    @contextmanager
    def gather(params):
        log.append({id(p) for p in params})
        for p in params:
            p.data = whole[p]
        try:
            yield
        finally:
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype)

    return gather


@pytest.mark.parametrize("sharding", ["zero3", "fsdp2"])
def test_a_sharded_weight_is_quantized_at_each_use_and_again_for_its_backward(sharding):
    """A ZeRO-3 weight is whole only while DeepSpeed gathers it (its module's forward, then its backward), an FSDP2
    one while FSDP unshards its unit (the whole tensor bears no mark: the trainer marks the module, `mark_sharded`):
    FP8Linear keeps no quantization of it (a whole FP8 copy of every layer is what sharding avoids) and saves W, not
    Wᵀ in FP8, for the backward, which quantizes it again. Outputs and gradients are bit for bit those of the cached
    path."""
    torch.manual_seed(0)
    cached, sharded = (FP8Linear(256, 384, bias=True) for _ in range(2))
    sharded.load_state_dict(cached.state_dict())
    x = torch.randn(3, 5, 256)
    if sharding == "zero3":
        sharded.weight.ds_id, sharded.weight.ds_shape = 1, torch.Size([384, 256])  # as gathered: the module "runs"
    else:
        mark_sharded(sharded)
    outs = []
    for layer in (cached, sharded):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        saved = y.grad_fn.saved_tensors[0]  # what waits for the backward: Wᵀ in FP8, or W itself
        assert saved.dtype == (torch.float32 if layer is sharded else torch.float8_e4m3fn)
        y.square().sum().backward()
        outs.append((y, xi.grad, layer.weight.grad, layer.bias.grad))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    assert cached._w_cache is not None and sharded._w_cache is None
    if sharding == "zero3":
        sharded.weight.data = torch.empty(0)  # sharded again: conversion and selection read the whole shape
        assert full_shape(sharded.weight) == (384, 256)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "autocast_bf16"])
@pytest.mark.parametrize("sharding", ["zero3", "fsdp2"])
def test_an_fp8_lora_layer_on_a_sharded_weight_merges_and_quantizes_again_for_its_backward(sharding, autocast):
    """An FP8 LoRA layer whose base weight is sharded keeps no FP8 copy of its merged weight, neither cached nor
    saved for the backward, which merges and quantizes it again (from the weights DeepSpeed or FSDP gathers again):
    outputs and every gradient are bit for bit those of the cached path, also when the forward runs under autocast
    and the backward does not (the merge ignores autocast)."""
    layers = []
    for marked in (False, True):
        model = fp8_lora_llama()
        layer = model.base_model.model.model.layers[1].mlp.down_proj
        if marked and sharding == "zero3":
            base = layer.get_base_layer()
            base.weight.ds_id, base.weight.ds_shape = 1, base.weight.shape  # as gathered: the module "runs"
        elif marked:
            mark_sharded(model)
        layers.append(layer)
    x = torch.randn(2, 5, 512)
    outs = []
    for layer in layers:
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(xi)
        saved = [t for t in y.grad_fn.saved_tensors if t is not None]
        fp8_saved = any(t.dtype == torch.float8_e4m3fn for t in saved)
        assert fp8_saved == (layer is layers[0]), "only the cached path keeps Q(W + s·B·A)ᵀ for the backward"
        y.square().sum().backward()
        outs.append((y, xi.grad, layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    assert layers[0]._fp8_cache is not None and layers[1]._fp8_cache is None


def test_the_export_gathers_each_module_with_the_weights_its_quantization_reads():
    """`iter_fp8_state(gather=...)` under emulated ZeRO-3: the stream is the unsharded one bit for bit; each FP8
    linear is read with its sibling group's weights gathered (q_proj's quantization is the stacked q/k/v one), one
    module at a time; what it yields is copied out of the gathered storage, and every parameter is sharded again
    after."""
    model = convert_to_fp8(tiny_policy(build_tokenizer()))
    expected = {n: t.clone() for n, t in iter_fp8_state(model)}
    q, k, v = (model.get_submodule(f"model.layers.0.self_attn.{x}_proj") for x in "qkv")
    assert q._group() is not None and q._group() is k._group()
    whole, log = _shard(model.parameters()), []
    stream = list(iter_fp8_state(model, gather=_emulated_gather(whole, log)))
    assert [n for n, _ in stream] == list(expected)
    for name, t in stream:
        assert torch.equal(_bits(t), _bits(expected[name])), name
        assert all(t.untyped_storage().data_ptr() != w.untyped_storage().data_ptr() for w in whole.values())
    qkv = {id(p) for m in (q, k, v) for p in m.parameters()}
    assert next(g for g in log if id(q.weight) in g) == qkv  # q_proj is read with k's and v's weights
    assert max(len(g) for g in log) <= 3 * 2  # never more than one group's weights (and biases) at once
    assert all(p.numel() == 0 for p in model.parameters())


@pytest.mark.parametrize("stream", ["fp8_generation_only", "bf16_sampler"])
def test_a_high_precision_learner_streams_the_same_under_gathering(stream):
    """The paper's other two configurations under emulated ZeRO-3: a BF16 learner with an FP8 sampler (the recipe
    quantizes the gathered weights in the stream) and a BF16 sampler (`iter_hp_state`) receive exactly the unsharded
    stream, and every parameter is sharded again after."""
    model = tiny_policy(build_tokenizer())

    def read(gather=None):
        if stream == "bf16_sampler":
            return list(iter_hp_state(model, gather=gather))
        return list(iter_fp8_state(model, FP8Recipe(), gather=gather))

    expected = [(n, t.clone()) for n, t in read()]
    assert any(t.dtype == torch.float8_e4m3fn for _, t in expected) == (stream == "fp8_generation_only")
    whole, log = _shard(model.parameters()), []
    got = read(_emulated_gather(whole, log))
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, t), (_, want) in zip(got, expected, strict=True):
        assert torch.equal(_bits(t), _bits(want)), name
        assert all(t.untyped_storage().data_ptr() != w.untyped_storage().data_ptr() for w in whole.values()), name
    assert log and all(p.numel() == 0 for p in model.parameters())


def test_a_model_built_sharded_converts_and_passes_the_vllm_layout_checks():
    """Under zero.Init the parameters are sharded before conversion: the experts are found and checked by their
    whole shapes (`ds_shape`), and TransformerEngine, whose linears copy the weights they are given, is refused."""
    model = tiny_qwen3_moe(build_tokenizer())
    _shard(model.parameters())
    convert_to_fp8(model)
    assert sum(isinstance(m, FP8Experts) for m in model.modules()) == 2
    assert all(m.num_experts == 4 for m in model.modules() if isinstance(m, FP8Experts))
    check_vllm_fp8_layers(model, FP8Recipe(), tp_size=1)
    with pytest.raises(RuntimeError, match=r"'te' does not run on sharded parameters \(ZeRO-3, FSDP2\)"):
        convert_to_fp8(tiny_qwen3_moe(build_tokenizer()), FP8Recipe(backend="te"), sharded=True)
    with pytest.raises(RuntimeError, match=r"'te' does not run on sharded parameters.*backend='auto'"):
        check_backend_runs_here(FP8Recipe(backend="te"), torch.device("cuda"), sharded=True)
