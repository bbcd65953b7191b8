"""The fast path's Triton kernels against the readable reference (`quantize_blockwise`, the `emulated` GEMM).

On a GPU the kernels are compiled and must match the reference bit for bit. Without one they run in Triton's CPU
interpreter (switched on in conftest), which executes the same kernel code with numpy but rounds fp32 -> E4M3 its own
way (round-half-up, no carry into the exponent): there, codes are compared bit for bit only on inputs whose scaled
values are already on the E4M3 grid, which still checks every index, mask, transpose, scale and layout; the rounding
itself is checked on the GPU.
"""

import copy
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import ACCUMULATION_DB, TMA_FAILS_ON_GPU, sqnr_db, triton_marks
from torch import nn

from trl_fp8.quant import FP8Linear, quantize_blockwise
from trl_fp8.quant.backends import emulated, resolve_backend
from trl_fp8.quant.backends._quantize import fast_act, fast_weight


pytestmark = triton_marks()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT_ROUNDING = DEVICE == "cuda"


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _on_grid(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Every finite E4M3 value, times one power of two per 128x128 tile: pow2 scales keep these exact."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x3F  # the two NaN codes -> 1.875
    tiles = torch.randint(-6, 7, (-(-rows // 128), -(-cols // 128)), generator=g).float()
    factor = (2.0**tiles).repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return codes.view(torch.float8_e4m3fn).float() * factor


def _unpadded(q, s, qt, st, m):
    """The fused quantizer's outputs without their padding, after checking it: q and its scales padded to a multiple
    of 4 rows, Xᵀ to whole 128-token blocks, with zero codes and scale_inv 1 (cuBLAS's layout, no copy)."""
    m_q, m_t = -(-m // 4) * 4, -(-m // 128) * 128
    assert q.shape[0] == m_q and s.shape[0] == m_q
    assert not _codes(q[m:]).any() and bool((s[m:] == 1).all())
    if qt is not None:
        assert qt.shape[1] == m_t and not _codes(qt[:, m:]).any()
        qt = qt[:, :m]
    return q[:m], s[:m], qt, st


def _quant_configs() -> list:
    """The quantizers' configs to test one by one: on a GPU every config the autotuner may pick (its pick can change
    between runs); in the interpreter, which ignores warps and whose tuned launch takes whole tiles, the smallest
    slice plain and slices with both variants (prefetch, running max) on."""
    if not torch.cuda.is_available():
        return [{"CHUNK": 16}, {"CHUNK": 32, "PREFETCH": True, "RUNNING_MAX": True}]
    from trl_fp8.quant.backends.triton_kernels import _QUANT_CONFIGS

    return [{**c.kwargs, "num_warps": c.num_warps} for c in _QUANT_CONFIGS]


def _config_id(config: dict | None) -> str:
    return "tuned" if config is None else "-".join(map(str, config.values()))


@pytest.fixture(params=[None, *_quant_configs()], ids=_config_id)
def act(request):
    """The act quantizer as it runs (autotuned on a GPU), and each config the autotuner chooses between: every one
    must give the reference's bits."""
    if request.param is None:
        return fast_act
    from trl_fp8.quant.backends.triton_kernels import quantize_act

    return lambda x, pow2_scales, with_t: quantize_act(x, pow2_scales=pow2_scales, with_t=with_t, config=request.param)


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 130), (130, 128)])
def test_fused_act_quantization_is_bit_exact_on_grid_inputs(shape, act):
    x = _on_grid(*shape, seed=shape[0]).to(DEVICE)
    padded = act(x, pow2_scales=True, with_t=True)
    q, s, qt, st = _unpadded(*padded, shape[0])
    rq, rs = quantize_blockwise(x, (1, 128), pow2_scales=True)
    rqt, rst = quantize_blockwise(x.t(), (1, 128), pow2_scales=True)
    assert torch.equal(_codes(q), _codes(rq)) and torch.equal(s, rs)
    assert torch.equal(_codes(qt), _codes(rqt)) and torch.equal(st, rst)
    # Scales come out column-major (outer-dim-major), the layout block-scaled GEMMs read.
    assert padded[1].stride() == (1, padded[0].shape[0]) and st.stride() == (1, shape[1])
    q2, s2, none_q, none_s = act(x, pow2_scales=True, with_t=False)
    assert torch.equal(_codes(_unpadded(q2, s2, None, None, shape[0])[0]), _codes(rq))
    assert none_q is None and none_s is None


@pytest.mark.parametrize("pow2", [False, True])
def test_fused_act_quantization_matches_reference_on_random_inputs(pow2, act):
    torch.manual_seed(0)
    x = (torch.randn(384, 260) * torch.logspace(-3, 3, 384)[:, None]).to(DEVICE, torch.bfloat16)
    x[5, :128] = 0  # an all-zero block: scale 1
    q, s, qt, st = _unpadded(*act(x, pow2_scales=pow2, with_t=True), x.shape[0])
    rq, rs = quantize_blockwise(x, (1, 128), pow2_scales=pow2)
    rqt, rst = quantize_blockwise(x.t(), (1, 128), pow2_scales=pow2)
    # Scales depend on the block amax alone, through a correctly rounded division: bit-exact on any machine.
    assert torch.equal(s, rs) and torch.equal(st, rst)
    if EXACT_ROUNDING:
        assert torch.equal(_codes(q), _codes(rq)) and torch.equal(_codes(qt), _codes(rqt))


@pytest.mark.parametrize("config", [None, *_quant_configs()], ids=_config_id)
@pytest.mark.parametrize("rows", [9, 130])
def test_act_columns_quantize_as_one_operand_without_making_it(rows, config):
    """Stacked siblings' output gradients, each quantized into its columns of one operand: the same bytes (padding
    included) as quantizing their concatenation, and each member's Xᵀ as quantizing it alone, in the layout cuBLAS
    reads (scale strides (1, N_member)). Members of other magnitudes, a NaN, and one stored column-major."""
    from trl_fp8.quant.backends.triton_kernels import quantize_act, quantize_act_columns

    torch.manual_seed(rows)
    xs = [torch.randn(rows, w).to(DEVICE, torch.bfloat16) for w in (256, 128, 128)]
    xs[1] = xs[1] * 1e3
    xs[2][rows - 1, 5] = float("nan")
    xs[2] = xs[2].t().contiguous().t()
    pow2 = rows == 130  # both scale rules, one per row count
    q, s, qts, sts = quantize_act_columns(xs, pow2_scales=pow2, with_t=True, config=config)
    rq, rs, _, _ = quantize_act(torch.cat(xs, 1), pow2_scales=pow2, with_t=False, config=config)
    assert torch.equal(_codes(q), _codes(rq)) and torch.equal(s, rs) and s.stride() == rs.stride()
    for x, qt, st in zip(xs, qts, sts, strict=True):
        _, _, rqt, rst = quantize_act(x, pow2_scales=pow2, with_t=True, config=config)
        assert torch.equal(_codes(qt), _codes(rqt)) and torch.equal(st, rst) and st.stride() == (1, x.shape[1])
    q2, s2, none_qts, _ = quantize_act_columns(xs, pow2_scales=pow2, with_t=False, config=config)
    assert torch.equal(_codes(q2), _codes(q)) and torch.equal(s2, s) and none_qts == [None] * 3


def test_act_columns_by_the_reference_and_refuse_straddling_blocks():
    """The reference's columns equal its quantization of the concatenation; a member that is not whole 128-column
    blocks is refused by name of the shapes, on both paths, before anything is quantized."""
    from trl_fp8.quant.backends._quantize import fast_act_columns, reference_act_columns

    xs = [torch.randn(5, 256), torch.randn(5, 128) * 1e-3]
    q, s, qts, sts = reference_act_columns(xs, False, True)
    rq, rs = quantize_blockwise(torch.cat(xs, 1), (1, 128))
    assert torch.equal(_codes(q), _codes(rq)) and torch.equal(s, rs)
    assert torch.equal(_codes(qts[1]), _codes(quantize_blockwise(xs[1].t(), (1, 128))[0]))
    bad = [torch.randn(5, 200).to(DEVICE), torch.randn(5, 128).to(DEVICE)]
    for fn in (reference_act_columns, fast_act_columns):
        with pytest.raises(ValueError, match=r"whole 128-column blocks.*\[\(5, 200\), \(5, 128\)\]"):
            fn(bad, False, True)


def _codes_with_nonfinite(rows: int, cols: int) -> torch.Tensor:
    """Every finite E4M3 value (pow2 scales >= 1 keep them exact, and so does the scale 1 of a non-finite block),
    with NaN and +-inf planted in different 1x128 and 128x128 blocks, one in a partial block."""
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x3F
    x = codes.view(torch.float8_e4m3fn).float()
    x[3, 5] = x[rows - 1, cols - 1] = float("nan")
    x[130, 140], x[7, 200] = float("inf"), float("-inf")
    return x


@pytest.mark.parametrize("pow2", [False, True])
def test_fused_act_quantization_keeps_nan_and_inf_as_the_reference_does(pow2, act):
    """A NaN activation must come out NaN, as in the reference (and in BF16): Triton's `tl.max` and `tl.minimum`
    drop NaN, which turned it into -448 and let a diverging run train on finite numbers. A block holding NaN or inf
    gets scale 1 in both usages; inf clamps to +-448."""
    x = _codes_with_nonfinite(200, 300).to(DEVICE)
    q, s, qt, st = _unpadded(*act(x, pow2_scales=pow2, with_t=True), x.shape[0])
    rq, rs = quantize_blockwise(x, (1, 128), pow2_scales=pow2, check_finite=False)
    rqt, rst = quantize_blockwise(x.t(), (1, 128), pow2_scales=pow2, check_finite=False)
    assert torch.equal(s, rs) and torch.equal(st, rst)
    assert s[3, 0] == 1 and st[5, 0] == 1 and s[130, 1] == 1 and st[200, 0] == 1
    assert torch.equal(q.float().isnan(), x.isnan()) and torch.equal(qt.float().isnan(), x.t().isnan())
    assert q[130, 140].float() == 448 and q[7, 200].float() == -448 and qt[140, 130].float() == 448
    if pow2 or EXACT_ROUNDING:
        assert torch.equal(_codes(q), _codes(rq)) and torch.equal(_codes(qt), _codes(rqt))


def _weight(w, pow2: bool, config: dict | None, check_finite: bool = True):
    """`(q, scale_inv, block_amax)`: the weight kernel as it runs (autotuned, checked: no amax handed back), or in
    one config the autotuner chooses between (unchecked)."""
    if config is None:
        q, s, _, _, amax = fast_weight(w, (128, 128), pow2, "w", check_finite=check_finite)
        return q, s, amax
    from trl_fp8.quant.backends.triton_kernels import quantize_weight

    q, s, _, _, amax = quantize_weight(w, pow2_scales=pow2, config=config)
    return q, s, amax


@pytest.mark.parametrize("config", [None, *_quant_configs()], ids=_config_id)
@pytest.mark.parametrize("pow2", [False, True])
def test_weight_kernel_keeps_nan_and_inf_as_the_reference_does(pow2, config):
    """Unchecked (a forward defers the check), the weight's NaN stays NaN and its block amax says so."""
    w = _codes_with_nonfinite(200, 300).to(DEVICE)
    q, s, amax = _weight(w, pow2, config, check_finite=False)
    rq, rs = quantize_blockwise(w, (128, 128), pow2_scales=pow2, check_finite=False)
    assert torch.equal(s, rs) and torch.equal(q.float().isnan(), w.isnan())
    assert torch.equal(amax.isnan(), torch.tensor([[True, False, False], [False, False, True]], device=DEVICE))
    assert torch.isinf(amax[1, 1]) and torch.isinf(amax[0, 1])
    if pow2 or EXACT_ROUNDING:
        assert torch.equal(_codes(q), _codes(rq))


@pytest.mark.parametrize("config", [None, *_quant_configs()], ids=_config_id)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])
@pytest.mark.parametrize("pow2", [False, True])
def test_weight_kernel_matches_reference(shape, pow2, config):
    """Codes, scales and (in a config, unchecked) each block's amax, the largest |w| whatever its sign: the
    reference's bits."""
    w = (_on_grid(*shape, seed=1) if pow2 else torch.randn(shape) * 0.02).to(DEVICE)
    q, s, amax = _weight(w, pow2, config)
    rq, rs = quantize_blockwise(w, (128, 128), pow2_scales=pow2)
    assert torch.equal(s, rs)
    if config is None:
        assert amax is None  # checked, not handed back
    else:
        padded = torch.nn.functional.pad(w.float().abs(), (0, -shape[1] % 128, 0, -shape[0] % 128))
        blocks = padded.view(padded.shape[0] // 128, 128, -1, 128).amax(dim=(1, 3))
        assert torch.equal(amax, blocks)
    if pow2 or EXACT_ROUNDING:
        assert torch.equal(_codes(q), _codes(rq))


@pytest.mark.parametrize("config", [None, *_quant_configs()], ids=_config_id)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (130, 128)])
def test_weight_kernel_writes_wt_in_the_same_pass(shape, config):
    """dgrad's Wᵀ (K-major codes and their scales), written by the weight kernel from the codes it just made: equal
    to `q.t()` bit for bit, NaN and partial blocks included, in every config the autotuner may pick (stores the GPU
    runs differently from the interpreter: a column-slice walk wrote non-zero codes into padding on an H200, RESULTS
    2026-12-04)."""
    from trl_fp8.quant.backends.triton_kernels import quantize_weight

    torch.manual_seed(shape[0])
    w = torch.randn(shape).to(DEVICE, torch.bfloat16)
    w[shape[0] - 1, 5], w[3, shape[1] - 1] = float("nan"), float("-inf")
    q, s, qt, st, amax = quantize_weight(w, pow2_scales=False, with_t=True, config=config)
    assert qt.shape == shape[::-1] and qt.is_contiguous() and st.is_contiguous()
    assert torch.equal(_codes(qt), _codes(q.t())) and torch.equal(st, s.t())
    q2, s2, none_q, none_s, amax2 = quantize_weight(w, pow2_scales=False, with_t=False, config=config)
    assert none_q is None and none_s is None
    assert torch.equal(_codes(q2), _codes(q)) and torch.equal(s2, s) and torch.equal(amax2.isnan(), amax.isnan())
    grid = _on_grid(*shape, seed=3).to(DEVICE)  # and the codes are the reference's
    rq, rs = quantize_blockwise(grid, (128, 128), pow2_scales=True)
    _, _, qt, st, _ = quantize_weight(grid, pow2_scales=True, with_t=True, config=config)
    assert torch.equal(_codes(qt), _codes(rq.t())) and torch.equal(st, rs.t())


@pytest.mark.parametrize("config", [None, *_quant_configs()], ids=_config_id)
def test_weight_kernel_quantizes_a_stack_of_experts_each_as_alone(config):
    """MoE experts (E, N, K) in one launch: each expert's codes, scales and block amax as its weight alone gives
    them, and its Wᵀ (K, N) for the grouped dgrad, from the same pass; the reference path (`fast_weight` on blocks
    the kernel does not take) gives the same stacks. A stack whose experts are not whole 128-row blocks is refused."""
    from trl_fp8.quant.backends.triton_kernels import quantize_weight

    torch.manual_seed(0)
    w = (torch.randn(3, 256, 200) * torch.tensor([1e-3, 1.0, 1e3])[:, None, None]).to(DEVICE, torch.bfloat16)
    w[2, 255, 199] = float("nan")
    q, s, qt, st, amax = quantize_weight(w, with_t=True, config=config)
    assert q.shape == (3, 256, 200) and s.shape == amax.shape == (3, 2, 2) and qt.shape == (3, 200, 256)
    assert st.shape == (3, 2, 2) and qt.is_contiguous() and st.is_contiguous()
    for e in range(3):
        q1, s1, qt1, st1, amax1 = quantize_weight(w[e], with_t=True, config=config)
        assert torch.equal(_codes(q[e]), _codes(q1)) and torch.equal(s[e], s1)
        assert torch.equal(amax[e].isnan(), amax1.isnan()) and torch.equal(amax[e].nan_to_num(), amax1.nan_to_num())
        assert torch.equal(_codes(qt[e]), _codes(qt1)) and torch.equal(st[e], st1)
    grid = torch.stack([_on_grid(256, 256, seed=e) for e in range(2)]).to(DEVICE)
    for block in ((128, 128), (64, 128)):  # the kernel, and the reference for blocks the kernel does not take
        q3, s3, qt3, st3, _ = fast_weight(grid, block, True, "w", with_t=True)
        for e in range(2):
            q2, s2, qt2, st2, _ = fast_weight(grid[e], block, True, "w", with_t=True)
            assert torch.equal(_codes(q3[e]), _codes(q2)) and torch.equal(s3[e], s2), block
            assert torch.equal(_codes(qt3[e]), _codes(qt2)) and torch.equal(st3[e], st2) and qt3.is_contiguous()
    for fn in (lambda w: quantize_weight(w), lambda w: fast_weight(w, (128, 128), False, "w")):
        with pytest.raises(ValueError, match=r"\(2, 200, 256\) must have whole 128-row blocks per expert"):
            fn(torch.randn(2, 200, 256, device=DEVICE))
    with pytest.raises(ValueError, match=r"\(2, 96, 256\) must have whole 64-row blocks per expert"):
        fast_weight(torch.randn(2, 96, 256, device=DEVICE), (64, 128), False, "w")


@pytest.mark.parametrize("config", [None, *_quant_configs()], ids=_config_id)
@pytest.mark.parametrize("pow2", [False, True])
def test_weight_rows_quantize_as_one_weight_without_making_it(pow2, config):
    """Stacked siblings' weights (q/k/v), each quantized into its rows of one weight and its columns of one Wᵀ: the
    same bytes as quantizing their concatenation, block amax (NaN included) and partial K blocks too. Members of
    other magnitudes, one stored column-major."""
    from trl_fp8.quant.backends.triton_kernels import quantize_weight, quantize_weight_rows

    torch.manual_seed(int(pow2))
    ws = [torch.randn(n, 200).to(DEVICE, torch.bfloat16) for n in (256, 128, 128)]
    ws[1] = ws[1] * 1e3
    ws[2][127, 199] = float("nan")
    ws[0] = ws[0].t().contiguous().t()
    ref = quantize_weight(torch.cat(ws), pow2_scales=pow2, with_t=True, config=config)
    for with_t in (True, False):
        q, s, qt, st, amax = quantize_weight_rows(ws, pow2_scales=pow2, with_t=with_t, config=config)
        assert torch.equal(_codes(q), _codes(ref[0])) and torch.equal(s, ref[1])
        assert torch.equal(amax.isnan(), ref[4].isnan()) and torch.equal(amax.nan_to_num(), ref[4].nan_to_num())
        if with_t:
            assert torch.equal(_codes(qt), _codes(ref[2])) and torch.equal(st, ref[3]) and qt.is_contiguous()
        else:
            assert qt is None and st is None


def test_weight_rows_by_the_reference_and_refuse_straddling_blocks():
    """The backends' `quantize_weight_rows`: the reference's equals the kernel's (Wᵀ a view without `with_t`, as
    `quantize_weight`'s); a member that is not whole 128-row blocks, or of another column count, is refused by name
    of the shapes on both paths, before anything is quantized."""
    from trl_fp8.quant.backends._quantize import fast_weight_rows, reference_weight_rows

    ws = [_on_grid(256, 384, seed=1).to(DEVICE), _on_grid(128, 384, seed=2).to(DEVICE) * 2**-6]
    for with_t in (True, False):
        fast, ref = fast_weight_rows(ws, True, with_t), reference_weight_rows([w.cpu() for w in ws], True, with_t)
        assert all(torch.equal(_codes(a).cpu(), _codes(b)) for a, b in ((fast[0], ref[0]), (fast[2], ref[2])))
        assert torch.equal(fast[1].cpu(), ref[1]) and torch.equal(fast[3].cpu(), ref[3])
        assert fast[2].is_contiguous() == with_t
    for bad in ([torch.randn(200, 128), torch.randn(128, 128)], [torch.randn(128, 128), torch.randn(128, 256)]):
        shapes = re.escape(str([tuple(w.shape) for w in bad]))
        for fn in (reference_weight_rows, fast_weight_rows):
            with pytest.raises(ValueError, match=f"whole 128-row blocks.*{shapes}"):
                fn([w.to(DEVICE) for w in bad], False, True)


@pytest.mark.parametrize("block", [(128, 128), (64, 128)])
def test_weight_quantizers_give_wt_contiguous_only_when_asked(block):
    """`with_t` is what `FP8Linear` asks for on a GPU, where dgrad reads Wᵀ K-major; without it Wᵀ is a free view.
    Both paths (the Triton kernel for 128x128 blocks, the reference for others) give the same values either way."""
    w = torch.randn(256, 384, device=DEVICE)
    q, s, qt, st, _ = fast_weight(w, block, False, "w", with_t=True)
    q_v, s_v, qt_v, st_v, _ = fast_weight(w, block, False, "w")
    assert qt.is_contiguous() and st.is_contiguous() and qt_v.data_ptr() == q_v.data_ptr() and not qt_v.is_contiguous()
    assert torch.equal(_codes(qt), _codes(qt_v)) and torch.equal(st, st_v) and torch.equal(_codes(q), _codes(q_v))


@pytest.mark.parametrize("pow2", [False, True])
def test_weight_quantizer_takes_other_blocks_through_the_reference(pow2):
    """The weight kernel tiles 128x128 only: a layer with other blocks (64x128 here, on the triton backend) is
    quantized in its own blocks, never in 128x128 ones (its scales would not fit its checkpoint)."""
    torch.manual_seed(0)
    w = (torch.randn(256, 384) * torch.logspace(-3, 1, 256)[:, None]).to(DEVICE)  # rows of different magnitudes
    q, s, _, _, _ = fast_weight(w, (64, 128), pow2, "w")
    rq, rs = quantize_blockwise(w, (64, 128), pow2_scales=pow2)
    assert s.shape == (4, 3) and torch.equal(s, rs) and torch.equal(_codes(q), _codes(rq))


@pytest.mark.parametrize("pow2", [False, True])
def test_a_subnormal_tile_gets_the_largest_finite_scale_as_in_the_reference(pow2):
    """448 / amax overflows for a subnormal amax (tiny gradients): the scale is then fp32's max, as in the reference,
    in the act quantizer (both usages) and the weight quantizer. On a GPU this also checks that the kernels keep
    subnormals (no flush to zero, which would give scale 1)."""
    from trl_fp8.quant.backends.triton_kernels import quantize_act, quantize_weight

    x = torch.randn(128, 256)
    x[:, :128] = torch.linspace(-1e-40, 1e-40, 128 * 128).reshape(128, 128)
    x = x.to(DEVICE)
    _, rs = quantize_blockwise(x, (1, 128), pow2_scales=pow2)
    _, rst = quantize_blockwise(x.t(), (1, 128), pow2_scales=pow2)
    _, rsw = quantize_blockwise(x, (128, 128), pow2_scales=pow2)
    assert bool((rs[:, 0] < 1e-30).all())  # 1 / fp32's max, not 1
    _, s, _, st = quantize_act(x, pow2_scales=pow2, with_t=True)
    assert torch.equal(s, rs) and torch.equal(st, rst)
    assert torch.equal(quantize_weight(x, pow2_scales=pow2)[1], rsw)


def test_weight_kernel_refuses_nonfinite_weights_by_name():
    w = torch.randn(256, 256, device=DEVICE)
    w[3, 200] = float("inf")
    with pytest.raises(ValueError, match=r"'layers.0.o_proj.weight'.*1 of 65536.*0 NaN, 1 inf"):
        fast_weight(w, (128, 128), False, "layers.0.o_proj.weight")
    amax = fast_weight(w, (128, 128), False, "layers.0.o_proj.weight", check_finite=False)[-1]
    assert amax.shape == (2, 2) and torch.isinf(amax[0, 1]) and torch.isfinite(amax[[0, 1, 1], [0, 0, 1]]).all()


def test_nonfinite_weight_is_refused_at_the_latest_by_the_next_export():
    """A forward defers the weight's NaN check (no host sync per layer, on every backend); `quantized_weight()`,
    which every sampler sync calls, then raises naming the layer, though the weight's quantization is cached.
    `tests/test_linear.py` holds the emulated backend to the same."""
    module, _ = _linear_pair(torch.randn(256, 256), torch.zeros(256), pow2=False)
    module.fp8_name = "model.layers.1.mlp.up_proj.weight"
    with torch.no_grad():
        module.weight[7, 7] = float("nan")
    y = module(torch.randn(3, 256, device=DEVICE))  # no raise
    if EXACT_ROUNDING:  # the interpreter's GEMM reads E4M3's NaN code as 480
        assert y.isnan().any()
    for _ in range(2):  # the check is not spent by the first refusal
        with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight.*1 NaN"):
            module.quantized_weight()


# 64-wide tiles share one weight scale per K block (a scalar in the kernel), 256-wide tiles span two (a vector); the
# TMA tile reads A and B by tensor descriptors (zero-filled beyond M, N and K), warp-specialized on a GPU.
TILES = {
    "default": None,
    "wide": {"BLOCK_M": 64, "BLOCK_N": 256, "GROUP_M": 4},
    "tma": {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 4, "TMA": True},
}
GPU_TILES = {"wide": dict(num_warps=8, num_stages=3), "tma": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3)}


@pytest.mark.parametrize("tile", ["default", "wide", pytest.param("tma", marks=TMA_FAILS_ON_GPU)])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("transposed_b", [False, True])
def test_triton_gemm_matches_emulated(b_block, transposed_b, tile, monkeypatch):
    from trl_fp8.quant.backends.triton_gemm_kernels import gemm

    if tile == "tma":
        monkeypatch.setenv("TRL_FP8_TRITON_TMA", "1")
    tile = TILES[tile] and {**TILES[tile], **(GPU_TILES[tile] if torch.cuda.is_available() else {})}

    torch.manual_seed(0)
    a, sa = quantize_blockwise(torch.randn(200, 300, device=DEVICE), (1, 128))
    if transposed_b:  # dgrad's operand: a transposed view of a (K, N) weight
        bt, sbt = quantize_blockwise(torch.randn(300, 136, device=DEVICE), b_block[::-1])
        b, sb = bt.t(), sbt.t()
    else:
        b, sb = quantize_blockwise(torch.randn(136, 300, device=DEVICE), b_block)
    out = gemm(a, sa, b, sb, b_block, torch.float32, config=tile)
    ref = emulated.gemm(a, sa, b, sb, b_block, torch.float32)
    assert out.shape == (200, 136)
    assert sqnr_db(ref, out) > ACCUMULATION_DB


_FAR_STORE = """
import sys, torch, triton
from trl_fp8.quant import quantize_blockwise
from trl_fp8.quant.backends.triton_gemm_kernels import _shape_bucket, gemm, gemm_kernel

device, (m, n, k) = sys.argv[1], (130, 128, 128)
torch.manual_seed(0)
a, sa = quantize_blockwise(torch.randn(m, k, device=device), (1, 128))
b, sb = quantize_blockwise(torch.randn(n, k, device=device), (128, 128))
# Rows 2**24 elements apart: rows 128 and 129 land past 2**31, as an (M, N) output with M * N > 2**31 would; 4 GiB
# of address space, of which only the rows written are ever touched.
c = torch.empty(2**24 * (m - 1) + n, dtype=torch.bfloat16, device=device).as_strided((m, n), (2**24, 1))
config = dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=4, TMA=False)
args = (a, b, c, sa, sb, m, n, k, *a.stride(), *b.stride(), *c.stride(), *sa.stride(), *sb.stride(),
        _shape_bucket(m, n, k), 0)
gemm_kernel[(triton.cdiv(m, 64) * triton.cdiv(n, 64),)](*args, B_ROWS_PER_SCALE=128, BLOCK_K=128, **config)
assert torch.equal(c, gemm(a, sa, b, sb, (128, 128), torch.bfloat16, config=config)), "rows differ"
"""


def test_triton_gemm_stores_past_2_31_elements():
    """The output offset is int64: with int32, rows past 2**31 elements (M * N > 2**31, e.g. 64k tokens through a 70B
    model's stacked gate/up) wrapped around to negative offsets, which crashed the interpreter (segfault) and would
    write outside the output on a GPU. A subprocess, so that such a crash fails this test alone."""
    run = subprocess.run([sys.executable, "-c", _FAR_STORE, DEVICE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"


def test_triton_gemm_keeps_tma_to_operands_it_can_read(monkeypatch):
    """TMA reads rows at 16-byte aligned addresses: the autotuner drops the TMA configs for operands whose rows are
    not (K = 300 bytes apart here), and asking for one anyway is an error that says why. (In the interpreter the
    autotuner runs the first config left: the other tests run the tuned path that way.)"""
    from trl_fp8.quant.backends.triton_gemm_kernels import _prune_configs, _tma_ok, configs, gemm

    a = torch.zeros(200, 300, dtype=torch.float8_e4m3fn, device=DEVICE)
    b = torch.zeros(136, 300, dtype=torch.float8_e4m3fn, device=DEVICE)
    a_s, b_s = torch.ones(200, 3, device=DEVICE), torch.ones(2, 3, device=DEVICE)
    aligned = torch.zeros(200, 304, dtype=torch.float8_e4m3fn, device=DEVICE)
    monkeypatch.setenv("TRL_FP8_TRITON_TMA", "1")  # on a GPU the TMA configs run only when asked
    assert not _tma_ok(a, b) and _tma_ok(aligned, aligned[:136])
    assert not _tma_ok(aligned[:, 1:], aligned[:136, 1:])  # rows aligned, base address not
    monkeypatch.setenv("TRL_FP8_TRITON_TMA", "0")
    assert not _tma_ok(aligned, aligned[:136])
    monkeypatch.delenv("TRL_FP8_TRITON_TMA")
    assert _tma_ok(aligned, aligned[:136]) == (DEVICE == "cpu")  # unset: on in the interpreter, off on a GPU
    assert any(c.kwargs["TMA"] for c in configs)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert _prune_configs(configs, {"TMA_OK": 1}) == configs[:1]
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the pruning a GPU sees
    assert _prune_configs(configs, {"TMA_OK": 0}) == [c for c in configs if not c.kwargs["TMA"]]
    assert _prune_configs(configs, {"TMA_OK": 1}) == configs
    monkeypatch.undo()
    monkeypatch.setenv("TRL_FP8_TRITON_TMA", "1")
    with pytest.raises(ValueError, match=r"TMA cannot read these operands.*\(300, 1\)"):
        gemm(a, a_s, b, b_s, (128, 128), torch.float32, config=TILES["tma"])
    monkeypatch.setenv("TRL_FP8_TRITON_TMA", "0")  # readable operands, but the switch is off: the error says that
    with pytest.raises(ValueError, match=r"TMA configs are off \(TRL_FP8_TRITON_TMA=0; on a GPU they run only with 1"):
        gemm(aligned, a_s, aligned[:136], b_s, (128, 128), torch.float32, config=TILES["tma"])


def _linear_pair(weight: torch.Tensor, bias: torch.Tensor, pow2: bool) -> tuple[FP8Linear, FP8Linear]:
    lin = nn.Linear(weight.shape[1], weight.shape[0], device=DEVICE, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        lin.bias.copy_(bias)
    fast = FP8Linear.from_linear(copy.deepcopy(lin), backend="triton", pow2_scales=pow2)
    slow = FP8Linear.from_linear(copy.deepcopy(lin), backend="emulated", pow2_scales=pow2)
    assert fast._backend_for(torch.device(DEVICE)) is resolve_backend("triton", torch.device(DEVICE))
    return fast, slow


def _fprop_dgrad_wgrad(module: FP8Linear, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_()
    y = module(x)
    (y * dy).sum().backward()  # dy is exactly the output gradient
    return y, x.grad, module.weight.grad, module.bias.grad


def test_fp8_linear_on_triton_backend_matches_emulated_exactly_on_grid_inputs():
    """fp32 data whose every quantization is exact: both paths use the same FP8 codes in all three GEMMs, so they
    differ only in how the GEMMs accumulate, on the GPU and in the interpreter alike."""
    fast, slow = _linear_pair(_on_grid(256, 300, seed=2).to(DEVICE), torch.randn(256).to(DEVICE), pow2=True)
    x = _on_grid(200, 300, seed=3).to(DEVICE).reshape(4, 50, 300)
    dy = _on_grid(200, 256, seed=4).to(DEVICE).reshape(4, 50, 256)
    for got, ref, what in zip(
        _fprop_dgrad_wgrad(fast, x, dy), _fprop_dgrad_wgrad(slow, x, dy), ("y", "dx", "dw", "db"), strict=True
    ):
        assert sqnr_db(ref, got) > ACCUMULATION_DB, what


@pytest.mark.skipif(not EXACT_ROUNDING, reason="the interpreter rounds to E4M3 and BF16 differently from hardware")
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_linear_on_triton_backend_matches_emulated_in_bf16(pow2):
    torch.manual_seed(0)
    fast, slow = _linear_pair(torch.randn(384, 512) * 0.02, torch.randn(384), pow2)
    x = torch.randn(2, 300, 512, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(2, 300, 384, device=DEVICE, dtype=torch.bfloat16)
    fast, slow = fast.to(DEVICE, torch.bfloat16), slow.to(DEVICE, torch.bfloat16)
    # Same codes, another summation order; the outputs are rounded to bf16 (8 bits: ~52 dB).
    for got, ref, what in zip(
        _fprop_dgrad_wgrad(fast, x, dy), _fprop_dgrad_wgrad(slow, x, dy), ("y", "dx", "dw", "db"), strict=True
    ):
        assert sqnr_db(ref, got) > 45, what


@pytest.mark.skipif(not EXACT_ROUNDING, reason="the interpreter's GEMM reads E4M3's NaN code as 480")
def test_a_nan_in_training_shows_in_the_outputs_and_gradients_as_in_the_oracle():
    """A token whose activation is NaN (an overflow upstream) turns its output row NaN, and a NaN output gradient
    turns dX and dW NaN, on the fast path as on `emulated`: a diverging run shows a NaN loss, not finite garbage."""
    torch.manual_seed(0)
    fast, slow = _linear_pair(torch.randn(256, 384) * 0.02, torch.randn(256), pow2=False)
    x = torch.randn(2, 70, 384, device=DEVICE)
    x[1, 9, 17] = float("nan")
    dy = torch.randn(2, 70, 256, device=DEVICE)
    dy[0, 3, 250] = float("nan")
    got, ref = _fprop_dgrad_wgrad(fast, x, dy), _fprop_dgrad_wgrad(slow, x, dy)
    for g, r, what in zip(got, ref, ("y", "dx", "dw", "db"), strict=True):
        assert g.isnan().any() and torch.equal(g.isnan(), r.isnan()), what
    assert got[0].isnan().sum() == 256 and got[0][1, 9].isnan().all()  # that token's row, and only it


def test_gpu_bench_reads_the_gemm_autotuner_it_records():
    """`gpu_bench` records what the Triton GEMM's autotuner timed, on a GPU only: without one the interpreter's
    autotuner (one config, untimed) stands in, so that the recording runs against Triton's real `Autotuner` before a
    GPU does."""
    import sys
    from pathlib import Path

    from trl_fp8.quant.backends.triton_gemm_kernels import gemm

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu_bench import _autotuning

    a, sa = quantize_blockwise(torch.randn(72, 640, device=DEVICE), (1, 128))  # a shape bucket no other test tunes
    b, sb = quantize_blockwise(torch.randn(136, 640, device=DEVICE), (128, 128))
    out = {}
    with _autotuning("triton", torch.device("cuda"), out, "128x128"):
        gemm(a, sa, b, sb, (128, 128), torch.float32)
    with _autotuning("triton", torch.device("cuda"), out, "again"):
        gemm(a, sa, b, sb, (128, 128), torch.float32)  # tuned already: nothing new to record
    assert "again" not in out
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter keeps one (plain) config: triton 3.9 does not time it, older versions time it at 0.
        assert set(out["128x128"]) <= {"plain"} and all(v == 0.0 for v in out["128x128"].values())
    else:  # K = 640 bytes a row: TMA can read both operands, so where switched on the best of each kind was timed
        kinds = {"plain", "tma"} if os.environ.get("TRL_FP8_TRITON_TMA") == "1" else {"plain"}
        assert set(out["128x128"]) == kinds and all(0 < v < math.inf for v in out["128x128"].values())
