"""Blockwise E4M3 quantization: the readable reference of the recipe.

A tensor is cut into blocks over its last two dims (`block_size = (rows, cols)`): `(128, 128)` for weights,
`(1, 128)` for activations and gradients (one block per row and per 128 elements of the contraction dim). Each block
gets one fp32 `scale` and is stored as

    q         = clamp(x * scale, -448, 448).to(float8_e4m3fn)      # round to nearest even
    scale_inv = 1 / scale                                          # what GEMMs and checkpoints carry

with TransformerEngine's `Float8BlockScaling` rule for the scale:

    scale = 448 / amax(|block|)       fp32, correctly rounded
    scale = 1                         if amax is 0, inf or NaN (nothing sensible to scale by)
    scale = float32 max               if 448 / amax overflows (subnormal amax)
    scale = 2**floor(log2(scale))     with `pow2_scales`, by masking the mantissa bits (never via log2)

Blocks at the edges cover only the elements that exist. Everything is computed in fp32 with tensor/tensor
division: `448.0 / t` in PyTorch is computed as `448 * (1 / t)`, which is not correctly rounded.
"""

import math

import torch


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
_F32_MAX = torch.finfo(torch.float32).max


def _check_block_size(block_size: tuple[int, int]) -> tuple[int, int]:
    sized = isinstance(block_size, tuple | list) and len(block_size) == 2
    if not sized or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in block_size):
        raise ValueError(f"block_size must be two positive ints (rows, cols), got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def _to_blocks(x: torch.Tensor, block_size: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """Zero-pads the last two dims to whole blocks and views them as (..., R, br, C, bc)."""
    rows, cols = x.shape[-2:]
    br, bc = block_size
    pad_r, pad_c = -rows % br, -cols % bc
    if pad_r or pad_c:
        # Zeros never raise an amax, so padded blocks are scaled by the elements that exist.
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    shape = (*x.shape[:-2], x.shape[-2] // br, br, x.shape[-1] // bc, bc)
    return x.reshape(shape), (rows, cols)


def _from_blocks(xb: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    *lead, nr, br, nc, bc = xb.shape
    return xb.reshape(*lead, nr * br, nc * bc)[..., : shape[0], : shape[1]]


@torch.no_grad()
def scale_from_amax(amax: torch.Tensor, *, pow2_scales: bool = False) -> torch.Tensor:
    """Returns the fp32 quantization multiplier `scale` for each block amax (TE's `compute_scale_from_amax`)."""
    amax = amax.to(torch.float32)
    scale = torch.full_like(amax, FP8_MAX) / amax  # tensor/tensor: correctly rounded
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _F32_MAX), scale)
    bad = (amax == 0) | ~torch.isfinite(amax)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if pow2_scales:
        # Keep sign and exponent, drop the mantissa: rounds the multiplier down to a power of two, bit-exactly.
        scale = (scale.view(torch.int32) & torch.tensor(-8388608, dtype=torch.int32, device=scale.device)).view(
            torch.float32
        )
    return scale


def _raise_nonfinite(x: torch.Tensor, name: str) -> None:
    count = int((~torch.isfinite(x)).sum())
    if count == 0:  # finite in its own dtype (float64), but not in fp32, where the scales are computed
        big = int((x.abs() > _F32_MAX).sum())
        raise ValueError(
            f"cannot quantize {name!r} to FP8: {big} of {x.numel()} elements are beyond float32's range "
            f"(|x| > {_F32_MAX:.4g}), in which the scales are computed"
        )
    nans = int(torch.isnan(x).sum())
    raise ValueError(
        f"cannot quantize {name!r} to FP8: {count} of {x.numel()} elements are not finite "
        f"({nans} NaN, {count - nans} inf); quantize_blockwise(..., check_finite=False) would quantize them anyway"
    )


@torch.no_grad()
def quantize_blockwise(
    x: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    pow2_scales: bool = False,
    check_finite: bool = True,
    name: str = "tensor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes `x` to E4M3 in blocks over its last two dims.

    Args:
        x (`torch.Tensor`):
            Input of any float dtype and at least 1 dim (a 1-D tensor is treated as one row), on any device.
        block_size (`tuple[int, int]`, *optional*, defaults to `(128, 128)`):
            Block shape over the last two dims: `(128, 128)` for weights, `(1, 128)` for activations.
        pow2_scales (`bool`, *optional*, defaults to `False`):
            Round each `scale` down to a power of two (TE's default, DeepGEMM's UE8M0).
        check_finite (`bool`, *optional*, defaults to `True`):
            Raise a `ValueError` naming `name` if `x` holds NaN or inf. With `False`, non-finite blocks get scale 1.
        name (`str`, *optional*, defaults to `"tensor"`):
            What `x` is, for error messages (e.g. the parameter name).

    Returns:
        `(q, scale_inv)`: `q` has the shape of `x` and dtype `float8_e4m3fn`; `scale_inv` is fp32 with shape
        `(..., ceil(rows / block_rows), ceil(cols / block_cols))`.
    """
    block_size = _check_block_size(block_size)
    if not x.is_floating_point():
        raise ValueError(f"cannot quantize {name!r}: expected a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"cannot quantize {name!r}: expected at least 1 dim, got a 0-dim tensor")
    squeeze = x.dim() == 1
    if squeeze:
        x = x.unsqueeze(0)
    xb, shape = _to_blocks(x.to(torch.float32), block_size)
    amax = xb.abs().amax(dim=(-3, -1), keepdim=True)
    # amax propagates NaN and inf, so checking the (small) amax tensor checks every element; the input is only
    # scanned again to count the culprits.
    if check_finite and not bool(torch.isfinite(amax).all()):
        _raise_nonfinite(x, name)
    scale = scale_from_amax(amax, pow2_scales=pow2_scales)
    q = (xb * scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale_inv = (torch.ones_like(scale) / scale).squeeze(-1).squeeze(-2)
    q = _from_blocks(q, shape)
    if squeeze:
        q, scale_inv = q.squeeze(0), scale_inv.squeeze(0)
    return q, scale_inv


@torch.no_grad()
def dequantize_blockwise(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize_blockwise`: `q.float() * scale_inv` per block, returned in `dtype`."""
    block_size = _check_block_size(block_size)
    if q.dim() == 0:
        raise ValueError("cannot dequantize a 0-dim tensor: FP8 codes have at least 1 dim")
    squeeze = q.dim() == 1
    if squeeze:
        q, scale_inv = q.unsqueeze(0), scale_inv.unsqueeze(0)
    expected = (*q.shape[:-2], math.ceil(q.shape[-2] / block_size[0]), math.ceil(q.shape[-1] / block_size[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for data of shape "
            f"{tuple(q.shape)} in {block_size} blocks"
        )
    qb, shape = _to_blocks(q.to(torch.float32), block_size)
    x = _from_blocks(qb * scale_inv.to(torch.float32)[..., :, None, :, None], shape).to(dtype)
    return x.squeeze(0) if squeeze else x
