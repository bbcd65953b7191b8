"""The `torch` backend's operands for `F.scaled_mm`, checked on CPU, where the blockwise kernel itself cannot run.

`F.scaled_mm` refuses blockwise scales on CPU ("Invalid scaling configuration"), so these tests hold
`cublas_operands` to the layout rules that ATen checks before calling cuBLAS (`_scaled_block1x128_block128x128` and
`_scaled_block1x128_block1x128` in `aten/src/ATen/native/cuda/ScaledBlas.cpp`, restated below), compute the GEMM
those operands describe, and check that on the training path (the fused quantizers' padded outputs, the weight's
cached transposes) nothing is copied. The real kernel is run against `emulated` by the GPU tests at the end of
this file and by `benchmarks/gpu_bench.py`.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import sqnr_db, tiny_config_kwargs, triton_marks
from torch import nn

from trl_fp8.quant import FP8Linear, quantize_blockwise
from trl_fp8.quant.backends import emulated, torch_scaled_mm
from trl_fp8.quant.backends._quantize import fast_act, fast_act_columns, fast_weight
from trl_fp8.quant.backends.torch_scaled_mm import cublas_operands


pytestmark = pytest.mark.skipif(not hasattr(F, "ScalingType"), reason="torch without F.scaled_mm")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_meta(t):
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _meta_checks_blockwise_layouts() -> bool:
    """Whether this torch's meta kernel of `F.scaled_mm` checks the blockwise layouts itself, probed with
    row-major A scales. torch 2.10-2.13 restate ATen's checks there; later versions leave the 1x128/128x128 recipes
    to the CUDA kernel (`validate_scaled_mm_v2_inputs` skips them), so nothing on CPU can run torch's own check."""
    if not hasattr(F, "ScalingType"):
        return False
    fp8 = torch.float8_e4m3fn
    a, b = torch.empty(8, 256, dtype=fp8), torch.empty(128, 256, dtype=fp8).t()
    bad_scale_a, scale_b = torch.empty(8, 2), torch.empty(1, 4).t()
    recipe_a, recipe_b = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
    try:
        F.scaled_mm(*map(_on_meta, (a, b, bad_scale_a, recipe_a, scale_b, recipe_b)), output_dtype=torch.bfloat16)
    except RuntimeError:
        return True
    return False


META_CHECKS_BLOCKWISE = _meta_checks_blockwise_layouts()


def _triton(fn):
    for mark in triton_marks():
        fn = mark(fn)
    return fn


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def assert_scaled_mm_layout(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b):
    """ATen's checks for `F.scaled_mm` with 1x128 A scales and 128x128 or 1x128 B scales (`mat_b` is (K, N)), plus
    what cuBLAS needs of the shapes: K in whole 128-blocks, M a multiple of 4, A row-major and B column-major."""
    m, k = mat_a.shape
    n = mat_b.shape[1]
    assert mat_b.shape[0] == k and k % 128 == 0 and m % 4 == 0
    assert mat_a.stride(1) == 1 and mat_b.stride(0) == 1, "A row-major, B column-major"
    assert recipe_a == F.ScalingType.BlockWise1x128
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert scale_a.shape == (m, k // 128) and scale_a.stride(0) == 1
    assert scale_a.stride(1) == m or scale_a.shape[1] == scale_a.stride(1) == 1
    if recipe_b == F.ScalingType.BlockWise128x128:
        kb4 = _round_up(k // 128, 4)
        assert n % 128 == 0, "N in whole 128-blocks: torch 2.10-2.13's meta wants N // 128 scales, ATen ceil(N / 128)"
        assert scale_b.shape == (kb4, n // 128) and scale_b.stride(0) == 1
        assert scale_b.stride(1) == kb4 or scale_b.shape[1] == scale_b.stride(1) == 1
    else:
        assert recipe_b == F.ScalingType.BlockWise1x128
        assert scale_b.shape == (n, k // 128) and scale_b.stride(0) == 1
        assert scale_b.stride(1) == n or scale_b.shape[1] == scale_b.stride(1) == 1
    if META_CHECKS_BLOCKWISE:  # and torch's own statement of the same checks, where it has one on CPU
        meta = map(_on_meta, (mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b))
        assert F.scaled_mm(*meta, output_dtype=torch.bfloat16).shape == (m, n)


def scaled_mm_as_described(mat_a, mat_b, scale_a, scale_b, recipe_b) -> torch.Tensor:
    """The product the operands describe, read through their layouts: A[i, k] * scale_a[i, k // 128] times
    B[k, j] * scale_b[k // 128, j // 128] (128x128) or scale_b[j, k // 128] (1x128), summed in fp32."""
    k = mat_a.shape[1]
    a = mat_a.float() * scale_a.repeat_interleave(128, 1)[:, :k]
    if recipe_b == F.ScalingType.BlockWise128x128:
        s = scale_b[: k // 128].repeat_interleave(128, 0).repeat_interleave(128, 1)
        b = mat_b.float() * s[:k, : mat_b.shape[1]]
    else:
        b = mat_b.float() * scale_b.t().repeat_interleave(128, 0)[:k]
    return a @ b


@pytest.mark.parametrize("m, k, n", [(130, 300, 144), (64, 512, 256), (3, 128, 384)])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_any_operands_are_padded_to_the_layout_and_keep_the_product(m, k, n, b_block):
    torch.manual_seed(0)
    a, sa = quantize_blockwise(torch.randn(m, k, device=DEVICE), (1, 128))
    b, sb = quantize_blockwise(torch.randn(n, k, device=DEVICE), b_block)
    mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b = cublas_operands(a, sa, b, sb, b_block)
    assert_scaled_mm_layout(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b)
    out = scaled_mm_as_described(mat_a, mat_b, scale_a, scale_b, recipe_b)
    assert not out[m:].any() and not out[:, n:].any()  # the padding rows and columns, which the backend drops
    assert sqnr_db(emulated.gemm(a, sa, b, sb, b_block, torch.float32), out[:m, :n]) > 100


def test_transposed_weight_scales_get_the_layout_too():
    """dgrad's B is Wᵀ, and its 128x128 scales may arrive as a transposed view (a sibling member's column slice of
    the stacked weight's scales, when its N/128 is a multiple of 4, needs no padding and stays one)."""
    torch.manual_seed(0)
    w, ws = quantize_blockwise(torch.randn(512, 256, device=DEVICE), (128, 128))  # W (N, K): scales (4, 2)
    dy, dys = quantize_blockwise(torch.randn(8, 512, device=DEVICE), (1, 128))
    b, sb = w.t(), ws.t()  # Wᵀ (256, 512) with (2, 4) scales of strides (1, 2)
    operands = cublas_operands(dy, dys, b, sb, (128, 128))
    assert_scaled_mm_layout(*operands)
    mat_a, mat_b, scale_a, _, scale_b, recipe_b = operands
    out = scaled_mm_as_described(mat_a, mat_b, scale_a, scale_b, recipe_b)[:8]
    assert sqnr_db(emulated.gemm(dy, dys, b, sb, (128, 128), torch.float32), out) > 100


def test_unsupported_weight_block_is_refused():
    a, sa = quantize_blockwise(torch.randn(4, 128), (1, 128))
    b, sb = quantize_blockwise(torch.randn(128, 128), (64, 64))
    with pytest.raises(ValueError, match=r"128x128 or 1x128 blocks for B, got \(64, 64\); use 'emulated'"):
        cublas_operands(a, sa, b, sb, (64, 64))


def _no_copy(prepared, originals) -> bool:
    return all(p.data_ptr() == o.data_ptr() for p, o in zip(prepared, originals, strict=True))


@_triton
@pytest.mark.parametrize("tokens", [130, 256])
def test_training_path_operands_need_no_copy(tokens):
    """fprop, dgrad and wgrad of a 512 -> 512 `FP8Linear`, with the operands exactly as `_FP8LinearFunction` passes
    them: every tensor reaches `F.scaled_mm` as the quantizer or the weight cache made it, even at a token count
    that is neither a multiple of 4 nor of 128 (RL batches rarely are). Only a weight dim that is not a multiple of
    512 costs a copy, of its small scale tensor (cuBLAS pads that to 4 blocks)."""
    torch.manual_seed(0)
    # What `FP8Linear._quantized` caches on a GPU: W and, for dgrad, Wᵀ written by the same kernel.
    w = torch.randn(512, 512, device=DEVICE) * 0.02
    w_q, w_s, w_qt, w_st, _ = fast_weight(w, (128, 128), False, "w", with_t=True)
    x_q, x_s, xt_q, xt_s = fast_act(torch.randn(tokens, 512, device=DEVICE), False, True)
    dy_q, dy_s, dyt_q, dyt_s = fast_act(torch.randn(tokens, 512, device=DEVICE), False, True)
    cases = {
        "fprop": ((x_q, x_s, w_q, w_s), (128, 128)),
        "dgrad": ((dy_q, dy_s, w_qt, w_st), (128, 128)),
        "wgrad": ((dyt_q, dyt_s, xt_q, xt_s), (1, 128)),
    }
    for name, ((a, sa, b, sb), block) in cases.items():
        mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b = cublas_operands(a, sa, b, sb, block)
        assert_scaled_mm_layout(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b)
        assert _no_copy((mat_a, mat_b, scale_a, scale_b), (a, b, sa, sb)), name
        ref = emulated.gemm(a, sa, b, sb, block, torch.float32)
        assert sqnr_db(ref, scaled_mm_as_described(mat_a, mat_b, scale_a, scale_b, recipe_b)) > 100, name


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch_scaled_mm.is_available(torch.device("cuda"))[0]),
    reason="needs an SM90 GPU with blockwise F.scaled_mm",
)
def test_fp8_modules_cache_wt_k_major_from_the_weight_kernel():
    """On a GPU every FP8 module's cached Wᵀ, dgrad's operand, is the weight kernel's K-major output (no copy left for
    `cublas_operands` to make): a linear alone, stacked q/k/v, and MoE experts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trl_fp8 import FP8Recipe, convert_to_fp8
    from trl_fp8.demo.tiny_moe import tiny_qwen3_moe
    from trl_fp8.quant.moe import FP8Experts

    model = convert_to_fp8(LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(num_hidden_layers=1))).to(DEVICE),
                           FP8Recipe(backend="torch"))  # fmt: skip
    attn = model.model.layers[0].self_attn
    for q, _, qt, st in (attn.o_proj._quantized(False), attn.q_proj._siblings.quantized(False)):
        assert qt.is_contiguous() and st.is_contiguous() and qt.data_ptr() != q.data_ptr()
    moe = convert_to_fp8(tiny_qwen3_moe().to(DEVICE), FP8Recipe(backend="torch"))
    experts = next(m for m in moe.modules() if isinstance(m, FP8Experts))
    experts.quantized("down_proj")
    assert experts._cache["down_proj"][3].is_contiguous()


@_triton
@pytest.mark.parametrize("tokens", [100, 300])  # one token block (a size-1 scale dim) and three
def test_stacked_siblings_operands_need_no_copy(tokens):
    """Stacked q|k|v quantize their output gradients into one dY (dgrad) and each member's dYᵀ apart (wgrad): all of
    them reach `F.scaled_mm` as the quantizer made them. (Row slices of one dYᵀ, as before, had scales with strides
    (1, N_total), which cost a copy each: still correct, and checked here too.)"""
    torch.manual_seed(0)
    dys = [torch.randn(tokens, n, device=DEVICE) for n in (256, 128, 128)]
    dy_q, dy_s, dyt_qs, dyt_ss = fast_act_columns(dys, False, True)
    _, _, xt_q, xt_s = fast_act(torch.randn(tokens, 256, device=DEVICE), False, True)
    w_q, w_s, w_qt, w_st, _ = fast_weight(torch.randn(512, 256, device=DEVICE), (128, 128), False, "w", with_t=True)
    cases = {"dgrad": ((dy_q, dy_s, w_qt, w_st), (128, 128))}
    for i, (q, st) in enumerate(zip(dyt_qs, dyt_ss, strict=True)):
        cases[f"wgrad {i}"] = ((q, st, xt_q, xt_s), (1, 128))
    _, _, dyt_q, dyt_s = fast_act(torch.cat(dys, 1), False, True)
    rows = ((0, 256), (256, 384), (384, 512))
    cases |= {f"wgrad {i}, row slice": ((dyt_q[r0:r1], dyt_s[r0:r1], xt_q, xt_s), (1, 128)) for i, (r0, r1) in
              enumerate(rows)}  # fmt: skip
    for name, ((a, sa, b, sb), block) in cases.items():
        mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b = cublas_operands(a, sa, b, sb, block)
        assert_scaled_mm_layout(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b)
        assert "row slice" in name or _no_copy((mat_a, mat_b, scale_a, scale_b), (a, b, sa, sb)), name
        ref = emulated.gemm(a, sa, b, sb, block, torch.float32)
        assert sqnr_db(ref, scaled_mm_as_described(mat_a, mat_b, scale_a, scale_b, recipe_b)) > 100, name


# The real kernel, on an SM90 GPU, against the oracle.
def _sm90() -> bool:
    return torch_scaled_mm.is_available(torch.device("cuda"))[0] if torch.cuda.is_available() else False


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU with blockwise F.scaled_mm")
def test_auto_takes_the_oracle_for_weight_blocks_the_fast_gemms_refuse():
    layer = FP8Linear(256, 256, backend="auto", weight_block_size=(64, 128), device="cuda")
    y = layer(torch.randn(8, 256, device="cuda"))
    assert layer._backend_for(y.device) is emulated
    assert FP8Linear(256, 256, backend="auto", device="cuda")._backend_for(y.device) is not emulated


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU with blockwise F.scaled_mm")
# (130, 300, 144): every padding `cublas_operands` does (M to 4, K to 128, N to 128 under 128x128 scales).
@pytest.mark.parametrize("m, k, n", [(128, 512, 384), (200, 512, 384), (130, 300, 144)])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_torch_backend_matches_emulated(m, k, n, b_block):
    a, sa = quantize_blockwise(torch.randn(m, k, device="cuda"), (1, 128))
    b, sb = quantize_blockwise(torch.randn(n, k, device="cuda"), b_block)
    fast = torch_scaled_mm.gemm(a, sa, b, sb, b_block, torch.float32)
    assert fast.shape == (m, n) and fast.is_contiguous()
    ref = emulated.gemm(a, sa, b, sb, b_block, torch.float32)
    # Same FP8 products; only the fp32 accumulation order differs.
    assert sqnr_db(ref, fast) > 60


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU with blockwise F.scaled_mm")
@pytest.mark.parametrize("tokens", [256, 130])  # 130: the quantizer's padding to cuBLAS's layout, dropped after
def test_torch_backend_linear_matches_emulated(tokens):
    torch.manual_seed(0)
    lin = nn.Linear(512, 384, device="cuda", dtype=torch.bfloat16)
    fast = FP8Linear.from_linear(copy.deepcopy(lin), backend="torch")
    slow = FP8Linear.from_linear(copy.deepcopy(lin), backend="emulated")
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    xf, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    fast(xf).float().pow(2).sum().backward()
    slow(xs).float().pow(2).sum().backward()
    assert sqnr_db(xs.grad, xf.grad) > 35 and sqnr_db(slow.weight.grad, fast.weight.grad) > 35
