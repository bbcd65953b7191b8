"""FP8Linear: all three GEMMs against the dequantize-then-matmul reference written out here, its error against a
high-precision nn.Linear, the weight cache, and backend selection. What follows a layer's later changes (moves, a new
backend or block size): tests/test_linear_state.py; the `torch` backend on a GPU: tests/test_torch_backend.py."""

import pytest
import torch
from conftest import HostSyncs, make_layer, sqnr_db, tiny_config_kwargs, triton_marks
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8
from trl_fp8.quant import FP8Linear, dequantize_blockwise, mark_weights_changed, quantize_blockwise
from trl_fp8.quant.backends import available_backends, emulated, resolve_backend, triton_gemm


def q_dq(x: torch.Tensor, block) -> torch.Tensor:
    return dequantize_blockwise(*quantize_blockwise(x, block), block)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tokens", [(4, 33), (130,), (1,)], ids=["batch_x_seq", "flat_partial_block", "one_token"])
@pytest.mark.parametrize("block", [(128, 128), (64, 128)], ids=["w128x128", "w64x128"])
def test_forward_and_gradients_match_dequantized_reference(bias, tokens, block):
    _, fp8 = make_layer(bias=bias)
    fp8.weight_block_size = block  # dgrad reads W's blocks transposed: a non-square block must not break it
    x = torch.randn(*tokens, 384, requires_grad=True)
    y = fp8(x)
    dy = torch.randn_like(y)
    y.backward(dy)

    x2d, dy2d = x.detach().reshape(-1, 384), dy.reshape(-1, 256)
    w = fp8.weight.detach()
    y_ref = q_dq(x2d, (1, 128)) @ q_dq(w, block).t()
    if bias:
        y_ref = y_ref + fp8.bias.detach()
    dx_ref = q_dq(dy2d, (1, 128)) @ q_dq(w, block)  # dgrad: dY (1x128 along N) . W (its blocks)
    dw_ref = q_dq(dy2d.t(), (1, 128)) @ q_dq(x2d.t(), (1, 128)).t()  # wgrad: both 1x128 along tokens

    torch.testing.assert_close(y.reshape(-1, 256), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(-1, 384), dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp8.weight.grad, dw_ref, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(fp8.bias.grad, dy2d.sum(0))
    assert x.grad.dtype == x.dtype and fp8.weight.grad.dtype == fp8.weight.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_against_high_precision_linear(dtype):
    """E4M3 keeps 3 mantissa bits: relative rounding error up to 2**-4, uniform over a step, i.e. a noise power of
    (2**-3 / 1.5)**2 / 12 of the signal for a mid-binade value -> about 32 dB per quantized operand, about 29 dB when
    two quantized operands multiply (independent errors add). Blockwise scales keep Gaussian data in the normal
    range, so every GEMM should land near 29 dB; 25 dB leaves margin for heavier tails and bf16 inputs."""
    ref, fp8 = make_layer(in_f=512, out_f=384)
    ref, fp8 = ref.to(dtype), fp8.to(dtype)
    x = torch.randn(64, 512, dtype=dtype)
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(64, 384, dtype=dtype)
    ref(x_ref).backward(dy)
    y = fp8(x_fp8)
    y.backward(dy)
    figures = {
        "fprop": sqnr_db(ref(x_ref), y),
        "dgrad": sqnr_db(x_ref.grad, x_fp8.grad),
        "wgrad": sqnr_db(ref.weight.grad, fp8.weight.grad),
    }
    print(f"SQNR vs {dtype} nn.Linear (dB):", {k: round(v, 1) for k, v in figures.items()})
    for gemm, db in figures.items():
        assert db >= 25.0, f"{gemm} SQNR {db:.1f} dB is below the 25 dB bound"


@pytest.mark.parametrize("fused", [False, True], ids=["for_loop", "fused"])
def test_quantized_weight_is_cached_until_the_weight_changes(fused):
    # The fused AdamW (transformers' default) does not bump parameter versions: the cache must still notice.
    _, fp8 = make_layer()
    opt = torch.optim.AdamW(fp8.parameters(), lr=1e-2, fused=fused)
    q1, s1 = fp8.quantized_weight()
    x = torch.randn(8, 384)
    fp8(x).sum().backward()  # the forward reuses the cached tensors
    assert fp8.quantized_weight()[0] is q1
    opt.step()
    q2, s2 = fp8.quantized_weight()
    assert q2 is not q1
    q_ref, s_ref = quantize_blockwise(fp8.weight.detach(), (128, 128))
    assert torch.equal(q2.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s2, s_ref)
    with torch.no_grad():
        fp8.weight.mul_(2)  # any in-place write
    assert torch.equal(fp8.quantized_weight()[1], s_ref * 2)
    fp8.weight.data.mul_(2)  # bypasses the version counter: unseen until said
    assert torch.equal(fp8.quantized_weight()[1], s_ref * 2)
    mark_weights_changed()
    assert torch.equal(fp8.quantized_weight()[1], s_ref * 4)
    fp8.pow2_scales = True  # another scale rule: other scales for the same weight
    q_ref, s_ref = quantize_blockwise(fp8.weight.detach(), (128, 128), pow2_scales=True)
    q3, s3 = fp8.quantized_weight()
    assert torch.equal(s3, s_ref) and torch.equal(q3.view(torch.uint8), q_ref.view(torch.uint8))
    # A weight loaded by assignment: a new tensor whose version counter (0) may equal the old one's.
    fp8.weight = nn.Parameter(torch.randn(256, 384))
    fp8.quantized_weight()
    fp8.weight = nn.Parameter(10 * torch.randn(256, 384))
    assert torch.equal(fp8.quantized_weight()[1], quantize_blockwise(fp8.weight.detach(), pow2_scales=True)[1])


def test_a_new_weight_on_the_old_ones_storage_is_not_served_its_fp8_weight():
    """A Parameter put in place of a freed one can take its storage's address and its version: only the tensor
    object tells them apart. The allocator hands the freed block back within a few tries."""
    x, layers = torch.randn(4, 256), []
    for _ in range(50):
        fp8 = FP8Linear.from_linear(nn.Linear(256, 128), backend="emulated", name="up_proj")
        with torch.no_grad():
            y_old = fp8(x)  # caches the FP8 weight
        old = (fp8.weight.data_ptr(), fp8.weight._version)
        fp8.weight = None  # the old weight's storage is free
        w = torch.empty(128, 256)
        w.copy_(5 * torch.randn(128, 256))  # one in-place write, as the old weight's init made: equal versions
        fp8.weight = nn.Parameter(w)
        layers.append(fp8)  # keeps each try's weight alive, so that the next try's storage is another
        if (w.data_ptr(), w._version) == old:
            break
    assert (w.data_ptr(), w._version) == old, "no try put the new weight on the old one's storage"
    q_ref, s_ref = quantize_blockwise(w)
    q, s = fp8.quantized_weight()
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    with torch.no_grad():
        y = fp8(x)
        fresh = FP8Linear.from_linear(nn.Linear(256, 128), backend="emulated")
        fresh.weight, fresh.bias = nn.Parameter(w.clone()), fp8.bias
        assert torch.equal(y, fresh(x)) and not torch.equal(y, y_old)


def test_swap_is_zero_copy():
    lin, _ = make_layer()
    fp8 = FP8Linear.from_linear(lin)
    assert fp8.weight is lin.weight and fp8.bias is lin.bias
    assert fp8.state_dict().keys() == lin.state_dict().keys()


def test_nonfinite_weight_error_names_the_layer():
    """The forward does not stop for the check (on a GPU that would be a host sync per layer); the next
    `quantized_weight()`, which every sampler sync and export calls, refuses the weight by name."""
    _, fp8 = make_layer()
    fp8.fp8_name = "model.layers.3.mlp.down_proj.weight"
    with torch.no_grad():
        fp8.weight[0, 0] = float("nan")
    assert torch.isnan(fp8(torch.randn(2, 384))).any()
    with pytest.raises(ValueError, match=r"model.layers.3.mlp.down_proj.weight.*1 NaN"):
        fp8.quantized_weight()
    with torch.no_grad():
        fp8.weight[0, 0] = 0.0  # a fixed weight is accepted again
    assert fp8.quantized_weight()[0].shape == (256, 384)


def test_backend_selection_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) is emulated
    status = available_backends(torch.device("cpu"))
    assert status["emulated"].startswith("available")
    if not torch.cuda.is_available():
        assert status["torch"].startswith("unavailable")
        with pytest.raises(RuntimeError, match=r"'torch' cannot run here(.|\n)*emulated: available"):
            resolve_backend("torch", torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"'te' cannot run here"):
        resolve_backend("te")
    with pytest.raises(ValueError, match="unknown FP8 backend 'fast'"):
        resolve_backend("fast")


@pytest.mark.skipif(
    not triton_gemm.is_available(torch.device("cpu"))[0], reason="needs Triton's interpreter (TRITON_INTERPRET=1)"
)
def test_the_triton_interpreter_on_cpu_says_once_that_its_e4m3_cast_is_not_exact(caplog):
    import trl_fp8.quant.backends as backends

    backends._auto_logged.discard("interpreter")
    with caplog.at_level("WARNING", logger=backends.__name__):
        for _ in range(2):
            resolve_backend("triton", torch.device("cpu"))
    assert [r.getMessage() for r in caplog.records if "interpreter" in r.getMessage()] == [
        "trl-fp8: backend='triton' on cpu runs Triton's interpreter (TRITON_INTERPRET=1), whose e4m3 cast is not "
        "exact: for testing the kernels' logic, not for training ('emulated' is the exact CPU path)"
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the CPU divides exactly either way")
def test_the_samplers_activation_scales_divide_on_the_gpu_as_on_the_cpu():
    """`amax / 448` with a Python float is a multiplication by its reciprocal on CUDA (PyTorch's true-divide kernel),
    1 ulp off for about half the groups; vLLM's kernel and the contract divide."""
    from trl_fp8.quant.w8a8 import quantize_per_token_group

    x = torch.randn(64, 1024) * torch.logspace(-3, 3, 64).unsqueeze(1)
    q_cpu, s_cpu = quantize_per_token_group(x)
    q_gpu, s_gpu = quantize_per_token_group(x.cuda())
    assert torch.equal(s_gpu.cpu(), s_cpu) and torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))


@pytest.fixture
def act_quantizations(monkeypatch) -> list[bool]:
    """Every activation quantization of the emulated backend, as its `with_t` flag (whether Xᵀ was made too)."""
    calls = []
    original = emulated.quantize_act

    def spy(x2d, pow2_scales, with_t):
        calls.append(with_t)
        return original(x2d, pow2_scales, with_t)

    monkeypatch.setattr(emulated, "quantize_act", spy)
    return calls


def test_no_grad_forwards_skip_the_wgrad_quantization(act_quantizations):
    """TRL's old-logprob and reference forwards run under no_grad: they must not pay for Xᵀ (wgrad's operand)."""
    _, fp8 = make_layer()
    x = torch.randn(4, 384)
    with torch.no_grad():
        y_inference = fp8(x)
    y = fp8(x)
    y.sum().backward()
    # no-grad forward: X only; training forward: X and Xᵀ; backward: dY and dYᵀ.
    assert act_quantizations == [False, True, True]
    assert torch.equal(y_inference, y.detach())
    # A frozen weight has no wgrad: its forward keeps no Xᵀ (activation memory), its backward still gives dX.
    act_quantizations.clear()
    fp8.weight.requires_grad_(False)
    fp8.bias.requires_grad_(False)
    x = torch.randn(4, 384, requires_grad=True)
    fp8(x).sum().backward()
    assert act_quantizations[0] is False and x.grad is not None


@pytest.mark.parametrize("backend", ["emulated", pytest.param("triton", marks=triton_marks())])
def test_fp8_adds_no_host_sync_to_a_training_step(backend):
    """The first H200 run lost more than half of the FP8 step to one host sync per layer (the weight's NaN check).
    Counted at dispatch, which sees the same ops on CPU: a training step (forward, backward, optimizer step, so
    every weight is quantized anew) of the FP8 model performs exactly the host syncs of the BF16 model."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels run compiled there

    def syncs(convert: bool) -> int:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(num_hidden_layers=1))).to(device)
        if convert:
            convert_to_fp8(model, FP8Recipe(backend=backend))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 160, (1, 9), device=device)

        def step():
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

        step()
        with HostSyncs() as counter:
            step()
        return counter.count

    assert syncs(convert=True) == syncs(convert=False)


def test_siblings_reading_one_input_share_its_quantization(act_quantizations):
    """q, k and v read the same X: it is quantized once for the three (and their wgrads share one saved Xᵀ), with
    outputs and gradients bit-identical to quantizing it three times; an in-place change of X re-quantizes."""
    siblings = [make_layer(seed=seed)[1] for seed in range(3)]

    def run(share: bool):
        act_quantizations.clear()
        x = torch.randn(2, 5, 384, generator=torch.Generator().manual_seed(0)).requires_grad_()
        outs = [m(x if share else x.clone()) for m in siblings]
        sum(o.pow(2).sum() for o in outs).backward()
        grads = [x.grad] + [p.grad.clone() for m in siblings for p in (m.weight, m.bias)]
        for m in siblings:
            m.zero_grad()
        return outs, grads, list(act_quantizations)

    shared_outs, shared_grads, shared_quantizations = run(share=True)
    outs, grads, separate_quantizations = run(share=False)
    assert shared_quantizations == [True] + [True] * 3  # X once, then dY per sibling in backward
    assert separate_quantizations == [True] * 6
    assert all(torch.equal(a, b) for a, b in zip(shared_outs + shared_grads, outs + grads, strict=True))

    act_quantizations.clear()
    x = torch.randn(4, 384)
    with torch.no_grad():
        siblings[0](x)
        x.mul_(2)  # a new version of X: its old quantization must not be reused
        second = siblings[1](x)
        expected = siblings[1](x.clone())
    assert act_quantizations == [False, False, False] and torch.equal(second, expected)


def test_inference_mode_forward():
    """Tensors made under `torch.inference_mode()` (TRL scores reward models so) keep no version counter: the
    shared-quantization match must not ask for one."""
    _, fp8 = make_layer()
    x = torch.randn(3, 384)
    with torch.inference_mode():
        y = fp8(x * 1)
        y2 = fp8(x * 1)
    assert torch.equal(y, y2) and torch.equal(y, fp8(x).detach())


@pytest.mark.parametrize("fuse_siblings", [True, False], ids=["stacked_siblings", "alone"])
def test_autocast_runs_the_linears_in_its_dtype_as_nn_linear_does(fuse_siblings):
    """Under autocast, nn.Linear (and TE's linear) compute from X cast to the autocast dtype and answer in it: so does
    FP8Linear, with the same output bits as when given that cast X outside autocast; dX arrives in X's own dtype."""
    torch.manual_seed(0)
    model = convert_to_fp8(
        LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(num_hidden_layers=1))),
        FP8Recipe(fuse_siblings=fuse_siblings),
    )
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 5, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert {t.dtype for t in (q, k, v)} == {torch.bfloat16}
    xb = x.detach().to(torch.bfloat16)
    for got, proj in ((q, attn.q_proj), (k, attn.k_proj), (v, attn.v_proj)):
        assert torch.equal(got, proj(xb)), proj.fp8_name
    (q.float().sum() + k.float().sum() + v.float().sum()).backward()
    assert x.grad.dtype == torch.float32 and attn.q_proj.weight.grad.dtype == torch.float32
