"""Blockwise quantization against a slow, independent reference: per-block Python/numpy float32 math and an E4M3
rounding oracle built from the 256 bit patterns of the format (bit-exact, no tolerance)."""

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_fp8.quant import (
    FP8_DTYPE,
    W8A8Linear,
    dequantize_blockwise,
    quantize_blockwise,
    quantize_per_token_group,
)


# All finite E4M3 values, sorted, with their bit patterns: the format's definition, independent of torch's cast.
_BITS = np.arange(256, dtype=np.uint8)
_VALUES = torch.from_numpy(_BITS.copy()).view(FP8_DTYPE).float().numpy()
_FINITE = np.isfinite(_VALUES)
_ORDER = np.argsort(_VALUES[_FINITE], kind="stable")
E4M3_VALUES = _VALUES[_FINITE][_ORDER].astype(np.float64)
E4M3_BITS = _BITS[_FINITE][_ORDER]


def e4m3_round(v: float) -> int:
    """Round-to-nearest-even onto E4M3 (after the clamp to ±448): returns the bit pattern."""
    v = min(max(v, -448.0), 448.0)
    i = int(np.searchsorted(E4M3_VALUES, v))
    cands = [j for j in (i - 1, i) if 0 <= j < len(E4M3_VALUES)]
    best = min(abs(E4M3_VALUES[j] - v) for j in cands)
    ties = [j for j in cands if abs(E4M3_VALUES[j] - v) == best]
    if len(ties) > 1:  # halfway: the even mantissa (lowest bit 0) wins
        ties = [j for j in ties if E4M3_BITS[j] % 2 == 0] or ties
    j = ties[0]
    if E4M3_VALUES[j] == 0.0:  # ±0: keep the sign of v
        return 0x80 if math.copysign(1.0, v) < 0 else 0x00
    return int(E4M3_BITS[j])


def reference_quantize(x: torch.Tensor, block: tuple[int, int], pow2: bool = False):
    """Block by block, element by element, in numpy float32 (correctly rounded, like TE's __fdiv_rn)."""
    x = x.float().numpy()
    rows, cols = x.shape
    br, bc = block
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    bits = np.zeros_like(x, dtype=np.uint8)
    scale_inv = np.zeros((nr, nc), dtype=np.float32)
    f32_max = np.finfo(np.float32).max
    for r in range(nr):
        for c in range(nc):
            blk = x[r * br : (r + 1) * br, c * bc : (c + 1) * bc]
            amax = np.float32(np.abs(blk).max())
            if amax == 0 or not np.isfinite(amax):
                scale = np.float32(1.0)
            else:
                with np.errstate(over="ignore"):
                    scale = np.float32(448.0) / amax
                if np.isinf(scale):
                    scale = np.float32(f32_max)
            if pow2:
                mantissa, exponent = math.frexp(float(scale))  # scale = m * 2**e, m in [0.5, 1)
                scale = np.float32(math.ldexp(1.0, exponent - 1))
            scale_inv[r, c] = np.float32(1.0) / scale
            for i in range(blk.shape[0]):
                for j in range(blk.shape[1]):
                    bits[r * br + i, c * bc + j] = e4m3_round(float(np.float32(blk[i, j]) * scale))
    return torch.from_numpy(bits).view(FP8_DTYPE), torch.from_numpy(scale_inv)


def many_scales(rows: int, cols: int, block: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Every block gets its own magnitude, so one wrong scale cannot hide behind its neighbours."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    mags = torch.exp2(torch.randint(-12, 12, (nr, nc), generator=g).float())
    return x * mags.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def assert_bits_equal(q: torch.Tensor, q_ref: torch.Tensor):
    diff = (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum().item()
    assert diff == 0, f"{diff} of {q.numel()} FP8 codes differ from the reference"


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
@pytest.mark.parametrize(
    "shape,block",
    [((256, 256), (128, 128)), ((130, 300), (128, 128)), ((5, 300), (1, 128)), ((3, 128), (1, 128))],
    ids=["2DTile", "2DTile_partial", "1DTile_partial", "1DTile"],
)
def test_bit_exact_against_reference(shape, block, pow2):
    x = many_scales(*shape, block, seed=shape[0])
    q, s = quantize_blockwise(x, block, pow2_scales=pow2)
    q_ref, s_ref = reference_quantize(x, block, pow2)
    assert_bits_equal(q, q_ref)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)


def reference_vllm_act_quantize(x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's activation quantization, vLLM's `per_token_group_quant_fp8`, group by group in numpy float32:
    s = max(amax, 1e-10) / 448 correctly rounded (its CUDA kernel: `y_s = local_absmax / max_8bit`), with `use_ue8m0`
    (pow2 scales) rounded up to a power of two; codes are the correctly rounded x / s, clamped to E4M3's range and
    rounded onto it."""
    x = x.float().numpy()
    rows, cols = x.shape
    groups = math.ceil(cols / 128)
    bits = np.zeros_like(x, dtype=np.uint8)
    scale_inv = np.zeros((rows, groups), dtype=np.float32)
    for r in range(rows):
        for g in range(groups):
            group = x[r, g * 128 : (g + 1) * 128]
            s = np.float32(max(np.float32(np.abs(group).max()), np.float32(1e-10))) / np.float32(448)
            if pow2:
                mantissa, exponent = math.frexp(float(s))  # s = m * 2**e, m in [0.5, 1)
                s = np.float32(math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent))
            scale_inv[r, g] = s
            for j, v in enumerate(group):
                bits[r, g * 128 + j] = e4m3_round(float(np.float32(v) / s))
    return torch.from_numpy(bits).view(FP8_DTYPE), torch.from_numpy(scale_inv)


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
def test_sampler_act_quantization_bit_exact_against_reference(pow2):
    x = many_scales(6, 300, (1, 128), seed=7)
    x[0, :128] = 448.0 * 2.0**-5 * torch.linspace(-1, 1, 128)  # amax exactly 448 * 2**-5: s is a power of two as is
    x[1, 128:256] = 0.0  # amax below eps
    q, s = quantize_per_token_group(x, 128, pow2_scales=pow2)
    q_ref, s_ref = reference_vllm_act_quantize(x, pow2)
    assert_bits_equal(q, q_ref)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    if pow2:  # the learner's pow2 rule lands on the same grid (but at an fp32 rounding of 448 * 2**k)
        _, s_learner = quantize_blockwise(x, (1, 128), pow2_scales=True)
        nonzero = s_ref > 1e-10
        torch.testing.assert_close(s[nonzero], s_learner[nonzero], atol=0, rtol=0)


def test_sampler_linear_sees_new_scales_under_the_same_codes():
    """`W8A8Linear` caches its dequantized weight between syncs. A load that rewrites only `weight_scale_inv` (a
    block whose values all doubled keeps its codes) must still reach the GEMM: the cache is keyed on both buffers."""
    layer = W8A8Linear(300, 200, bias=False, dtype=torch.float32)
    q, scale_inv = quantize_blockwise(many_scales(200, 300, (128, 128), seed=3), (128, 128))
    layer.weight.copy_(q)
    layer.weight_scale_inv.copy_(scale_inv)
    x = torch.randn(5, 300)
    y = layer(x)
    layer.weight_scale_inv.mul_(2)  # exact: every product and partial sum doubles
    assert torch.equal(layer(x), 2 * y)
    layer.weight.copy_((-q.float()).to(FP8_DTYPE))  # the codes alone change (negation is exact in E4M3)
    assert torch.equal(layer(x), -2 * y)
    # New buffers (`assign=True`), fresh tensors whose versions equal the old ones' (0): the cache was served.
    state = {"weight": q.clone(), "weight_scale_inv": scale_inv.clone()}
    fresh = W8A8Linear(300, 200, bias=False, dtype=torch.float32)
    assert not fresh(x).any()  # its zero weights, dequantized and cached
    fresh.load_state_dict(state, assign=True)
    assert torch.equal(fresh(x), y)
    with torch.inference_mode():  # buffers that keep no version counter: dequantized at each call
        built = W8A8Linear(300, 200, bias=False, dtype=torch.float32)
        built.load_state_dict(state)
        assert torch.equal(built(x), y)
        built.weight_scale_inv.mul_(2)
        assert torch.equal(built(x), 2 * y)


def test_a_dtype_move_keeps_the_sampler_linears_fp8_weight_and_fp32_scales():
    """`.to(dtype)` and `.half()` convert every floating-point buffer, e4m3 codes and fp32 scales included: the
    codes would become bf16 values and the scales be rounded to bf16. As vLLM's layer, `W8A8Linear` keeps them as
    they are; only the bias takes the new dtype, and the output the input's."""
    torch.manual_seed(0)
    layer = W8A8Linear(300, 200, bias=True, dtype=torch.float32)
    q, scale_inv = quantize_blockwise(many_scales(200, 300, (128, 128), seed=3), (128, 128))
    layer.weight.copy_(q)
    layer.weight_scale_inv.copy_(scale_inv)
    layer.bias.copy_(torch.randn(200))
    x = torch.randn(5, 300)
    for move in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.float64)):
        moved = move(copy.deepcopy(layer))
        assert moved.weight.dtype == FP8_DTYPE and moved.weight_scale_inv.dtype == torch.float32
        assert torch.equal(moved.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(moved.weight_scale_inv, scale_inv)
        same_bias = copy.deepcopy(layer)
        same_bias.bias.copy_(moved.bias.float())  # the one rounding a dtype move may make
        assert torch.equal(moved(x), same_bias(x))


def _identity_sampler_linear(features: int, *, bias: bool, pow2_scales: bool = False) -> W8A8Linear:
    """A sampler linear whose weight is exactly the identity (codes 1.0, scale_inv 1): it returns its input as the
    sampler quantized it, plus its bias."""
    layer = W8A8Linear(features, features, bias=bias, dtype=torch.float32, pow2_scales=pow2_scales)
    layer.weight.copy_(torch.eye(features).to(FP8_DTYPE))
    return layer


def _as_sampler_quantizes(x: torch.Tensor, pow2: bool) -> torch.Tensor:
    return dequantize_blockwise(*quantize_per_token_group(x, 128, pow2_scales=pow2), (1, 128))


def test_sampler_linear_adds_its_bias_and_follows_its_scale_rule():
    """Qwen2's q/k/v carry biases, which the sampler adds; with the recipe's pow2 scales it quantizes activations
    as vLLM's E8M0 path does (the two grids differ on this input, so the test tells them apart)."""
    torch.manual_seed(0)
    x = torch.randn(5, 256)
    biased = _identity_sampler_linear(256, bias=True)
    biased.bias.copy_(torch.linspace(-3, 3, 256))
    assert torch.equal(biased(x), _as_sampler_quantizes(x, False) + biased.bias)
    assert not torch.equal(_as_sampler_quantizes(x, True), _as_sampler_quantizes(x, False))
    for pow2 in (False, True):
        assert torch.equal(
            _identity_sampler_linear(256, bias=False, pow2_scales=pow2)(x), _as_sampler_quantizes(x, pow2)
        )


def test_dequantize_refuses_scales_that_do_not_cover_the_blocks_and_takes_1d_back():
    q, s = quantize_blockwise(torch.randn(256, 256))
    with pytest.raises(ValueError, match="scale_inv has shape"):
        dequantize_blockwise(q, s[:, :1])  # too few K blocks would broadcast silently over each row
    x = torch.tensor([1.0, -2.0, 0.5, 448.0, 3.0] * 60)  # 300 values on the E4M3 grid, in 3 blocks of 1x128
    q, s = quantize_blockwise(x, (1, 128))  # a 1-D tensor is one row
    assert q.shape == (300,) and s.shape == (3,) and torch.equal(dequantize_blockwise(q, s, (1, 128)), x)


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
def test_a_block_of_subnormals_gets_the_largest_finite_scale(pow2):
    """448 / amax overflows fp32 for a subnormal amax: the scale is then fp32's max, never inf (whose scale_inv 0
    would turn the block's zeros into NaN on the way back)."""
    x = many_scales(4, 256, (1, 128), seed=5)
    x[1, :128] = torch.linspace(-1e-40, 1e-40, 128)
    q, s = quantize_blockwise(x, (1, 128), pow2_scales=pow2)
    q_ref, s_ref = reference_quantize(x, (1, 128), pow2)
    assert_bits_equal(q, q_ref)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    assert torch.isfinite(dequantize_blockwise(q, s, (1, 128))).all() and s[1, 0] > 0


def test_block_amax_maps_to_448():
    x = torch.randn(256, 256)
    x[3, 5] = 7.25  # the amax of block (0, 0)
    x[200, 140] = -0.03  # the amax of block (1, 1), made small
    x[128:, 128:] = x[128:, 128:].clamp(-0.029, 0.029)
    x[0:128, 0:128].clamp_(-7.0, 7.0)
    x[3, 5] = 7.25
    q, s = quantize_blockwise(x, (128, 128))
    assert q[3, 5].float().item() == 448.0
    assert q[200, 140].float().item() == -448.0
    assert q[:128, :128].float().abs().max().item() == 448.0


def test_zero_block_dequantizes_to_zero_with_scale_one():
    x = torch.randn(256, 384)
    x[128:, 128:256] = 0
    q, s = quantize_blockwise(x, (128, 128))
    assert s[1, 1].item() == 1.0
    assert torch.equal(dequantize_blockwise(q, s)[128:, 128:256], torch.zeros(128, 128))


def test_partial_edge_blocks_use_only_existing_elements():
    x = torch.full((130, 129), 1.0)
    x[129, 128] = 3.0  # the only element of the corner block (1, 1)
    q, s = quantize_blockwise(x, (128, 128))
    assert s.shape == (2, 2)
    assert s[1, 1].item() == torch.tensor(1.0) / (torch.tensor(448.0) / torch.tensor(3.0))
    assert q[129, 128].float().item() == 448.0
    x_dq = dequantize_blockwise(q, s)
    assert torch.equal(x_dq[:128], x[:128])  # blocks of 1.0 alone round-trip exactly
    assert x_dq[129, 128] == 448.0 * s[1, 1] and x_dq[128, 128] == 144.0 * s[1, 1]
    torch.testing.assert_close(x_dq[129, 128], torch.tensor(3.0))


def test_pow2_scales_are_powers_of_two_and_never_overflow():
    x = many_scales(384, 256, (128, 128), seed=3)
    q, s = quantize_blockwise(x, (128, 128), pow2_scales=True)
    mantissa, _ = torch.frexp(s)
    assert torch.all(mantissa == 0.5), "every scale_inv must be an exact power of two"
    xb = x.reshape(3, 128, 2, 128)
    scale = 1.0 / s  # exact for powers of two
    assert torch.all((xb * scale[:, None, :, None]).abs() <= 448.0), "a pow2 scale must never push a value past 448"


def test_pow2_rounds_down_where_log2_is_off_by_one():
    # 448 / amax is just above 2**20 here, where 2**ceil(log2(amax / 448)) famously gives 2**-21 (research §0).
    amax = torch.tensor(2.1362312e-4)
    x = torch.zeros(1, 128)
    x[0, 0] = amax
    _, s = quantize_blockwise(x, (1, 128), pow2_scales=True)
    assert s.item() == 2.0**-20


@pytest.mark.parametrize("value", [float("inf"), -float("inf"), 1e38])
def test_values_beyond_range_saturate_never_nan(value):
    x = torch.randn(2, 128)
    x[0, 7] = value
    q, s = quantize_blockwise(x, (1, 128), check_finite=False)
    assert not torch.isnan(q.float()).any()
    assert q[0, 7].float().item() == math.copysign(448.0, value)


def test_nonfinite_input_raises_with_name_and_count():
    x = torch.randn(4, 256)
    x[0, 0] = float("nan")
    x[1, 1] = float("inf")
    with pytest.raises(ValueError, match=r"'layers.0.q_proj.weight'.*2 of 1024 elements.*1 NaN, 1 inf"):
        quantize_blockwise(x, (128, 128), name="layers.0.q_proj.weight")
    # float64 values past fp32's range are finite in their own dtype: the error says what is wrong with them.
    x = torch.randn(4, 256, dtype=torch.float64)
    x[2, 3] = -1e300
    with pytest.raises(ValueError, match=r"'w'.*1 of 1024 elements are beyond float32's range"):
        quantize_blockwise(x, (128, 128), name="w")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_any_float_dtype_and_leading_dims(dtype):
    x = torch.randn(2, 3, 5, 256).to(dtype)
    q, s = quantize_blockwise(x, (1, 128))
    assert q.shape == x.shape and s.shape == (2, 3, 5, 2)
    q_ref, s_ref = reference_quantize(x.float().reshape(-1, 256), (1, 128))
    assert_bits_equal(q.reshape(-1, 256), q_ref)
    assert torch.equal(s.reshape(-1, 2), s_ref)


def test_bad_block_size_and_scale_shape_raise():
    for bad in [(0, 128), 128, (True, 128), (128,)]:
        with pytest.raises(ValueError, match="block_size must be two positive ints"):
            quantize_blockwise(torch.randn(4, 4), bad)
    with pytest.raises(ValueError, match="cannot quantize 'step': expected at least 1 dim, got a 0-dim tensor"):
        quantize_blockwise(torch.tensor(3.0), name="step")
    q, s = quantize_blockwise(torch.randn(256, 256))
    with pytest.raises(ValueError, match="scale_inv has shape"):
        dequantize_blockwise(q, s[:1])
    with pytest.raises(ValueError, match="cannot dequantize a 0-dim tensor"):
        dequantize_blockwise(q[0, 0], s[0, 0])


_blocks = st.sampled_from([(128, 128), (1, 128), (32, 64)])


@st.composite
def blocked_tensors(draw):
    block = draw(_blocks)
    rows = draw(st.integers(1, 260))
    cols = draw(st.integers(1, 260))
    seed = draw(st.integers(0, 2**16))
    return many_scales(rows, cols, block, seed), block


@settings(max_examples=40, deadline=None)
@given(blocked_tensors(), st.booleans())
def test_round_trip_error_within_half_an_e4m3_step(case, pow2):
    x, block = case
    q, s = quantize_blockwise(x, block, pow2_scales=pow2)
    x_dq = dequantize_blockwise(q, s, block)
    scale_inv = s.repeat_interleave(block[0], 0)[: x.shape[0]].repeat_interleave(block[1], 1)[:, : x.shape[1]]
    scaled = (x / scale_inv).abs()
    # Half a step of E4M3 at each value: 2**-4 relative in the normal range, 2**-10 absolute among subnormals;
    # the 1e-6 covers the fp32 rounding of x * scale.
    half_step = torch.maximum(scaled * 2.0**-4, torch.full_like(scaled, 2.0**-10)) * (1 + 1e-6)
    assert torch.all((x - x_dq).abs() <= half_step * scale_inv)


@settings(max_examples=40, deadline=None)
@given(blocked_tensors(), st.booleans())
def test_quantizing_a_dequantized_tensor_again_is_the_identity(case, pow2):
    x, block = case
    q, s = quantize_blockwise(x, block, pow2_scales=pow2)
    x_dq = dequantize_blockwise(q, s, block)
    q2, s2 = quantize_blockwise(x_dq, block, pow2_scales=pow2)
    if pow2:
        # Power-of-2 scales make the dequantized values an exact fixed point. (The codes may not be: a block whose
        # amax rounded to exactly 224 = 448 / 2 gets twice the scale and half the codes on the second pass.)
        assert torch.equal(dequantize_blockwise(q2, s2, block), x_dq)
    else:
        # fp32 scales keep every code; 448 * (1 / scale) and back may move a scale by one ulp.
        assert_bits_equal(q2, q)
        torch.testing.assert_close(s2, s, rtol=2.5e-7, atol=0)
