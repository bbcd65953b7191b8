"""The fast path's Triton quantize kernels against the readable reference (`quantize_blockwise`); the Triton GEMM
and `FP8Linear` on the Triton backend: tests/test_triton_gemm.py.

On a GPU the kernels are compiled and must match the reference bit for bit. Without one they run in Triton's CPU
interpreter (switched on in conftest), which executes the same kernel code with numpy but rounds fp32 -> E4M3 its own
way (round-half-up, no carry into the exponent): there, codes are compared bit for bit only on inputs whose scaled
values are already on the E4M3 grid, which still checks every index, mask, transpose, scale and layout; the rounding
itself is checked on the GPU.
"""

import re

import pytest
import torch
from conftest import on_grid, triton_marks

from trl_fp8.quant import quantize_blockwise
from trl_fp8.quant.backends._quantize import fast_act, fast_weight


pytestmark = triton_marks()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT_ROUNDING = DEVICE == "cuda"


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


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
    x = on_grid(*shape, seed=shape[0]).to(DEVICE)
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
    w = (on_grid(*shape, seed=1) if pow2 else torch.randn(shape) * 0.02).to(DEVICE)
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
    grid = on_grid(*shape, seed=3).to(DEVICE)  # and the codes are the reference's
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
    grid = torch.stack([on_grid(256, 256, seed=e) for e in range(2)]).to(DEVICE)
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

    ws = [on_grid(256, 384, seed=1).to(DEVICE), on_grid(128, 384, seed=2).to(DEVICE) * 2**-6]
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
