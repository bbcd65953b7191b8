"""The TransformerEngine backend. Without TE (every machine this project tests on) only the selection logic and its
errors run; the GPU tests (marked `te`) check TE's numerics against the reference where TE is installed."""

import copy
import re
import sys
import types

import pytest
import torch
from conftest import sqnr_db, tiny_config_kwargs
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8, iter_fp8_state
from trl_fp8.quant import FP8Linear, quantize_blockwise
from trl_fp8.quant.backends import available_backends, resolve_backend
from trl_fp8.quant.te_linear import is_te_linear, te_recipe_status, te_status


TE_OK = te_status()[0] and torch.cuda.is_available()


@pytest.mark.skipif(TE_OK, reason="checks the messages of a machine without TransformerEngine")
def test_without_transformer_engine_the_choice_is_explained():
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs()))
    status = available_backends()["te"]
    assert status.startswith("unavailable: ") and te_status()[1] in status
    with pytest.raises(RuntimeError, match=r"backend 'te' cannot run here: .*transformer_engine|not on a GPU"):
        convert_to_fp8(copy.deepcopy(model), FP8Recipe(backend="te"))
    with pytest.raises(RuntimeError, match="'te' cannot run here"):
        resolve_backend("te")
    # "auto" falls through to trl-fp8's own linears, never half-converting the model.
    converted = convert_to_fp8(model, FP8Recipe(backend="auto"))
    layers = [m for m in converted.modules() if isinstance(m, FP8Linear)]
    assert len(layers) == 3 * 7 and not any(is_te_linear(m) for m in converted.modules())


def _no_visible_gpu(**_):
    raise RuntimeError("No CUDA GPUs are available")  # what torch.cuda says with CUDA_VISIBLE_DEVICES=""


@pytest.mark.parametrize(
    "fake_te,reason",
    [
        (dict(__version__="2.8.0"), r"TransformerEngine 2.8.0 is too old for this backend \(needs >= 2.20\)"),
        # `autocast` arrived before the block-scaling query: a TE with only the first is too old too, not GPU-less.
        (dict(__version__="2.3.0", autocast=None), r"TransformerEngine 2.3.0 is too old for this backend"),
        # 2.9-2.16 have both names, but not the `constants.DType` the export reads: refused here, so that `auto`
        # falls back instead of failing inside convert_to_fp8.
        (
            dict(__version__="2.16.0", autocast=None, is_fp8_block_scaling_available=lambda **_: (True, "")),
            r"TransformerEngine 2.16.0 is too old for this backend",
        ),
        (
            dict(__version__="2.20.2", autocast=None, is_fp8_block_scaling_available=_no_visible_gpu),
            "cannot query the GPU: No CUDA GPUs",
        ),
    ],
    ids=["too_old", "without_block_scaling", "without_dtype_constants", "no_visible_gpu"],
)
def test_a_transformer_engine_that_cannot_run_the_recipe_is_explained(monkeypatch, fake_te, reason):
    """TE cannot be installed here, so stand-ins (the one mock in this file) play an old TE and a TE whose GPU
    queries raise, as on a machine with TE but no visible GPU: `auto` must skip it with the reason, not crash."""
    package, module = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.pytorch")
    for key, value in fake_te.items():
        setattr(module, key, value)
    package.pytorch = module
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", module)
    te_status.cache_clear()
    try:
        ok, why = te_status()
        assert not ok and re.search(reason, why), why
        assert re.search(reason, available_backends()["te"])
    finally:
        te_status.cache_clear()


@pytest.mark.parametrize(
    "capability,message",
    [((9, 0), r"^TransformerEngine on SM90$"), ((10, 0), r"^SM100: .* emulates this recipe with MXFP8 .*pow2_scales")],
    ids=["hopper", "blackwell"],
)
def test_a_usable_transformer_engine_says_how_it_runs_the_recipe(monkeypatch, capability, message):
    """Stand-ins again (TE and a GPU cannot run here): a TE whose block-scaling query says yes, and the compute
    capability of a Hopper or a Blackwell GPU, where TE runs this recipe as MXFP8."""
    # The GPU machine that runs this file has no TRL, which the trainers' checks import (before the stand-in TE,
    # which TRL's imports would trip over).
    check_backend_runs_here = pytest.importorskip("trl_fp8.trainers.checks").check_backend_runs_here
    package, module = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.pytorch")
    module.autocast, module.is_fp8_block_scaling_available = None, lambda return_reason: (True, "")
    package.__version__ = "2.20.2"  # TE keeps its version on the package
    package.pytorch = module
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    te_status.cache_clear()
    try:
        ok, why = te_status()
        assert ok and re.search(message, why), why
        # With fp32 scales TE cannot run the recipe on Blackwell: `te` says so before anything is converted, and
        # `auto` leaves TE out (the model here is on the CPU, so `auto` would leave it out anyway).
        assert te_recipe_status(pow2_scales=True) == (True, why)
        ok32, why32 = te_recipe_status(pow2_scales=False)
        if capability[0] >= 10:
            assert (
                not ok32 and why32 == "SM100: TransformerEngine runs this recipe as MXFP8 there, set pow2_scales=True"
            )
            with pytest.raises(RuntimeError, match="'te' cannot run here: SM100: .*set pow2_scales=True"):
                check_backend_runs_here(FP8Recipe(backend="te"), torch.device("cuda"))
        else:
            assert (ok32, why32) == (True, why)
            check_backend_runs_here(FP8Recipe(backend="te"), torch.device("cuda"))
        check_backend_runs_here(FP8Recipe(backend="te", pow2_scales=True), torch.device("cuda"))
    finally:
        te_status.cache_clear()


def test_te_is_chosen_for_the_device_the_model_will_train_on(monkeypatch, caplog):
    """Under DeepSpeed ZeRO-1/2 the model is still on the CPU when the trainer converts it (DeepSpeed moves it at
    `train()`): `auto` left TE out and `te` refused, whatever GPU the run trains on. Stand-ins again (TE cannot run
    here): a TE that runs the recipe on an SM90, and its linear class, which records where it is built."""
    import trl_fp8.quant.convert as convert

    package, module = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.pytorch")
    module.autocast, module.is_fp8_block_scaling_available = None, lambda return_reason: (True, "")
    package.__version__, package.pytorch = "2.20.2", module
    monkeypatch.setitem(sys.modules, "transformer_engine", package)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    built = []

    class StandInTELinear(nn.Linear):
        @classmethod
        def from_linear(cls, linear, *, pow2_scales, name=None, device=None):
            built.append((name, device))
            return linear

    monkeypatch.setattr(convert, "te_linear_class", lambda: StandInTELinear)
    te_status.cache_clear()
    try:
        model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs()))
        with pytest.raises(RuntimeError, match=r"'te' cannot run here: the model is not on a GPU \(pass `device=`"):
            convert_to_fp8(copy.deepcopy(model), FP8Recipe(backend="te"))
        with caplog.at_level("INFO", logger=convert.__name__):
            auto = convert_to_fp8(copy.deepcopy(model), FP8Recipe(backend="auto"))
        assert sum(isinstance(m, FP8Linear) for m in auto.modules()) == 3 * 7 and not built
        assert "backend='auto' leaves TransformerEngine out (the model is not on a GPU" in caplog.text
        for backend in ("te", "auto"):
            built.clear()
            convert_to_fp8(copy.deepcopy(model), FP8Recipe(backend=backend), device="cuda")
            assert len(built) == 3 * 7 and {d for _, d in built} == {torch.device("cuda")}
    finally:
        te_status.cache_clear()


te_only = pytest.mark.skipif(not TE_OK, reason=f"needs TransformerEngine on a GPU ({te_status()[1]})")


@pytest.mark.gpu
@pytest.mark.te
@te_only
# Both scale rules, whatever NVTE_FP8_BLOCK_SCALING_FP32_SCALES said when TE was imported: the rule is set on the
# recipe instance.
@pytest.mark.parametrize("pow2", [False, True])
def test_te_weight_grid_is_the_reference_grid_and_names_are_unchanged(pow2):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs())).cuda()
    keys = set(model.state_dict())
    convert_to_fp8(model, FP8Recipe(backend="te", pow2_scales=pow2))
    assert sum(is_te_linear(m) for m in model.modules()) == 3 * 7
    assert set(model.state_dict()) == keys  # no `_extra_state`, same names
    stream = dict(iter_fp8_state(model))
    # Nothing but the model's own tensors and their scales: no `_extra_state`, no empty bias of TE's (Llama has none).
    assert set(stream) <= keys | {key + "_scale_inv" for key in keys}
    w = model.model.layers[1].mlp.down_proj.weight.detach()
    q_ref, s_ref = quantize_blockwise(w, (128, 128), pow2_scales=pow2)
    q, s = stream["model.layers.1.mlp.down_proj.weight"], stream["model.layers.1.mlp.down_proj.weight_scale_inv"]
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@pytest.mark.gpu
@pytest.mark.te
@te_only
# 300 tokens pad to 304, 276 to 288: TE's wgrad needs the token count 16-aligned (8 would give 280 and fail).
@pytest.mark.parametrize("tokens,bias", [(300, True), (276, False)])
def test_te_linear_matches_emulated(tokens, bias):
    from trl_fp8.quant.te_linear import te_linear_class

    torch.manual_seed(0)
    lin = nn.Linear(512, 384, bias=bias, device="cuda", dtype=torch.bfloat16)
    fast = te_linear_class().from_linear(copy.deepcopy(lin), pow2_scales=FP8Recipe().pow2_scales, name="l")
    slow = FP8Linear.from_linear(copy.deepcopy(lin), backend="emulated", pow2_scales=FP8Recipe().pow2_scales)
    x = torch.randn(3, tokens // 3, 512, device="cuda", dtype=torch.bfloat16)
    xf, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert (fast.bias is None) == (not bias)  # not TE's empty placeholder
    yf, ys = fast(xf), slow(xs)
    yf.float().square().sum().backward()
    ys.float().square().sum().backward()
    # Same FP8 operands, other accumulation (Hopper's ~14-bit MMA sums per 128 block) and bf16 outputs: > 40 dB,
    # where a different quantization would give FP8's ~29 dB.
    assert yf.shape == ys.shape
    for got, ref in ((yf, ys), (xf.grad, xs.grad), (fast.weight.grad, slow.weight.grad)):
        assert sqnr_db(ref, got) > 40


@pytest.mark.gpu
@pytest.mark.te
@te_only
def test_te_export_refuses_nonfinite_weights_and_keeps_frozen_biases():
    """TE's block quantizer drops NaN from a block's amax and gives an inf amax scale 1: its scales stay finite, so
    the export checks the weight itself. TE registers a trainable bias of its own: a frozen one must stay frozen."""
    from trl_fp8.quant.te_linear import te_linear_class

    lin = nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16)
    lin.bias.requires_grad_(False)
    fast = te_linear_class().from_linear(lin, pow2_scales=False, name="layers.0.q_proj")
    assert fast.weight.requires_grad and not fast.bias.requires_grad
    with torch.no_grad():
        fast.weight[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"cannot quantize 'layers.0.q_proj.weight' to FP8: 1 of 65536 .*1 NaN"):
        fast.quantized_weight()


class _ViewingLinear(torch.autograd.Function):
    """Y = X · Wᵀ returned as TE's `_Linear` returns it, a view made inside the function (`out.view(-1, ..., N)`);
    a stand-in for TE, which cannot run here (fprop only matters: dgrad dX = dY · W, wgrad dW = dYᵀ · X)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        out = x @ w.t()
        return out.view(-1, out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy @ w, dy.t() @ x


def test_an_output_like_te_s_may_be_clamped_in_place_through_modifiable():
    """OLMo 1.7's `clip_qkv` clamps q, k and v in place; autograd refuses that on TE's output, a view its autograd
    function made. `modifiable` hands out the same memory (no copy) as a tensor that may be, with the gradients of
    clamping out of place."""
    from trl_fp8.quant.te_linear import modifiable

    torch.manual_seed(0)
    x, w, dy = torch.randn(6, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True), torch.randn(6, 16)
    with pytest.raises(RuntimeError, match="view and is being modified inplace"):
        _ViewingLinear.apply(x, w).clamp_(-1, 1)

    def run(in_place: bool):
        x.grad = w.grad = None
        y = modifiable(_ViewingLinear.apply(x, w)) if in_place else _ViewingLinear.apply(x, w)
        y = y.clamp_(-1, 1) if in_place else y.clamp(-1, 1)
        y.backward(dy)
        return y, x.grad, w.grad

    y, dx, dw = run(in_place=True)
    assert 0.1 < (y.abs() == 1).float().mean() < 0.9  # the clamp decides part of every gradient
    assert all(torch.equal(a, b) for a, b in zip((y, dx, dw), run(in_place=False), strict=True))


@pytest.mark.gpu
@pytest.mark.te
@te_only
def test_te_linear_output_may_be_clamped_in_place():
    from trl_fp8.quant.te_linear import te_linear_class

    torch.manual_seed(0)
    fast = te_linear_class().from_linear(nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16), pow2_scales=False)
    x = torch.randn(2, 24, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grads = []
    for in_place in (True, False):
        x.grad = fast.weight.grad = None
        y = fast(x)
        y = y.clamp_(-0.5, 0.5) if in_place else y.clamp(-0.5, 0.5)
        y.float().square().sum().backward()
        grads.append((y.detach(), x.grad, fast.weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
