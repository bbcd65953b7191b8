"""The sampler's numerics: vLLM's W8A8 block-FP8 linear (DeepSeek-V3 checkpoint format), in readable torch.

Weights arrive already quantized by the trainer (`weight` e4m3 (N, K) + `weight_scale_inv` fp32
(ceil(N/128), ceil(K/128))), so the sampler's weight grid is the learner's. Activations are quantized the way
vLLM's `per_token_group_quant_fp8` does it on CUDA (its `per_token_group_fp8_quant` kernel computes
`y_s = local_absmax / max_8bit`; the Triton fallback divides too), per token in groups of 128 along K:

    s = max(amax, 1e-10) / 448              # a dequant multiplier
    q = clamp(x / s, -448, 448).to(e4m3)

which differs from the learner's `scale = 448 / amax`, `scale_inv = 1 / scale` (two roundings) in the last bit of
some scales: that is a real source of sampler/learner mismatch, and the importance-sampling correction is there for
it. With the recipe's `pow2_scales`, vLLM runs DeepGEMM's E8M0 scales (`VLLM_USE_DEEP_GEMM_E8M0=1`, `use_ue8m0`),
rounded up to a power of two:

    s = 2**ceil(log2(max(amax, 1e-10) / 448))

which is the learner's pow2 rule but for an amax within an fp32 rounding of 448 * 2**k. Here the power of two is
taken from the bits, exactly; vLLM's kernels take an fp32 `log2`, which can round an `s` a few ulps above a power of
two down to it.
"""

import math

import torch
from torch import nn

from .blockwise import FP8_DTYPE, FP8_MAX, dequantize_blockwise
from .linear import version_of
from .staleness import serial


VLLM_ACT_EPS = 1e-10


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Rounds positive fp32 values up to a power of two: the exponent, plus one unless the mantissa bits are zero.
    Non-finite values pass through."""
    bits = s.view(torch.int32)
    exponent = bits & 0x7F800000
    up = torch.where((bits & 0x007FFFFF) != 0, exponent + (1 << 23), exponent)
    return torch.where(torch.isfinite(s), up.view(torch.float32), s)


@torch.no_grad()
def quantize_per_token_group(
    x: torch.Tensor, group_size: int = 128, *, eps: float = VLLM_ACT_EPS, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic activation quantization: returns `(q, scale_inv)` with `scale_inv` of shape
    `(..., ceil(K / group_size))`; `pow2_scales` rounds `scale_inv` up to a power of two (vLLM's `use_ue8m0`)."""
    k = x.shape[-1]
    pad = -k % group_size
    xf = x.to(torch.float32)
    if pad:
        xf = nn.functional.pad(xf, (0, pad))
    xg = xf.reshape(*xf.shape[:-1], -1, group_size)
    amax = xg.abs().amax(dim=-1, keepdim=True).clamp_min(eps)
    # tensor/tensor, as vLLM's kernel divides: on CUDA, PyTorch takes `tensor / python_float` as a multiplication by
    # the float's reciprocal, 1 ulp off for about half the groups.
    scale_inv = amax / torch.full_like(amax, FP8_MAX)
    if pow2_scales:
        scale_inv = _pow2_ceil(scale_inv)
    q = (xg / scale_inv).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(xf.shape)[..., :k], scale_inv.squeeze(-1)


class W8A8Linear(nn.Module):
    """A frozen block-FP8 linear as vLLM's `Fp8LinearMethod` holds it: `weight` (e4m3), `weight_scale_inv`
    (fp32), optional `bias` in the model dtype. Used by the reference sampling engine.

    The GEMM is emulated: both operands are dequantized and multiplied in fp32, i.e. exact products of the FP8
    values with fp32 accumulation (what Hopper's block-scaled GEMMs approximate with split accumulators).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device=None,
        *,
        pow2_scales: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.pow2_scales = pow2_scales  # activation scales as vLLM quantizes them for the recipe (E8M0 with pow2)
        n_blocks, k_blocks = math.ceil(out_features / 128), math.ceil(in_features / 128)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale_inv", torch.ones(n_blocks, k_blocks, dtype=torch.float32, device=device))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        self._w_dq: tuple[tuple[int, int], torch.Tensor] | None = None

    def _apply(self, fn, recurse=True):
        # To torch, e4m3 and fp32 buffers are floating point like any: `.to(dtype)` and `.half()` would make the codes
        # bf16 values and round the scales. As vLLM's layer, this one keeps them; only their device follows.
        held = {name: self._buffers[name] for name in ("weight", "weight_scale_inv")}
        super()._apply(fn, recurse)
        for name, old in held.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        self._w_dq = None
        return self

    def dequantized_weight(self) -> torch.Tensor:
        # Keyed on the buffers, and their version counters: an in-place load (sync, load_state_dict) or new buffers
        # (`load_state_dict(assign=True)`, whose fresh tensors may share the old ones' versions) invalidate it.
        # Buffers made under inference mode keep no version: dequantized at each call.
        w, s = self.weight, self.weight_scale_inv
        key = (serial(w), version_of(w), w.data_ptr(), serial(s), version_of(s), s.data_ptr())
        if self._w_dq is None or self._w_dq[0] != key or None in key:
            self._w_dq = (key, dequantize_blockwise(w, s, (128, 128)))
        return self._w_dq[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale_inv = quantize_per_token_group(x, 128, pow2_scales=self.pow2_scales)
        x_dq = dequantize_blockwise(xq, x_scale_inv, (1, 128))
        with torch.autocast(x.device.type, enabled=False):
            # [..., K] @ [K, N] -> [..., N], accumulated in fp32
            y = x_dq @ self.dequantized_weight().t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weight=e4m3 128x128, act=e4m3 1x128{', pow2 scales' if self.pow2_scales else ''}"
        )
