"""The `torch` backend: PyTorch's native block-scaled FP8 GEMM, `torch.nn.functional.scaled_mm` with
`BlockWise1x128` x `BlockWise128x128` (or `BlockWise1x128`) scales, on Hopper (SM90) with CUDA >= 12.9.

Layout rules of `F.scaled_mm`'s blockwise path (`_scaled_block1x128_block128x128` and `_block1x128_block1x128` in
ATen's `ScaledBlas.cpp`): `mat_b` is column-major (`B.t()` of a row-major B); 1x128 scales are (rows, K/128) and
outer-dim-major (strides (1, rows)); 128x128 scales are (round_up(K/128, 4), N/128) with strides (1, round_up(K/128,
4)), i.e. a padded row-major (N/128, K/128) transposed; cuBLAS wants K in whole 128-blocks and M a multiple of 4.
With 128x128 scales B's N is padded to whole 128-blocks as well: the meta kernel of torch 2.10-2.13
(`_meta_registrations.py`, which `torch.compile` traces through) wants N // 128 scale columns, ATen's CUDA check
ceil(N / 128), and only a whole N satisfies both.
The fused Triton quantizers write activations in exactly this layout (rows padded to 4, Xᵀ to whole 128-token
blocks) and `FP8Linear` caches the weight's (its dims are whole 128-blocks, or it stays in high precision), so
`cublas_operands` copies nothing on the training path; anything else (the reference quantizer's output) is padded
here.
"""

import torch
import torch.nn.functional as F

from ._quantize import fast_act as quantize_act
from ._quantize import fast_act_columns as quantize_act_columns
from ._quantize import fast_weight as quantize_weight
from ._quantize import fast_weight_rows as quantize_weight_rows


name = "torch"
__all__ = ["gemm", "is_available", "quantize_act", "quantize_act_columns", "quantize_weight", "quantize_weight_rows"]


def is_available(device: torch.device | None = None) -> tuple[bool, str]:
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (needs torch >= 2.10)"
    if not torch.cuda.is_available():
        return False, "no CUDA device (the blockwise scaled_mm kernel needs an SM90 GPU)"
    index = device.index if device is not None and device.type == "cuda" and device.index is not None else None
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        return False, f"the GPU is SM{major}{minor}; blockwise scaled_mm runs only on SM90 (Hopper)"
    cuda = torch.version.cuda or "0.0"
    if tuple(int(v) for v in cuda.split(".")[:2]) < (12, 9):
        return False, f"torch was built with CUDA {cuda}; blockwise scaled_mm needs CUDA >= 12.9"
    return True, f"SM90 with CUDA {cuda}"


def _pad_k(q: torch.Tensor, block_k: int = 128) -> torch.Tensor:
    pad = -q.shape[-1] % block_k
    return F.pad(q.view(torch.uint8), (0, pad)).view(q.dtype) if pad else q


def _pad_rows(q: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -q.shape[0] % multiple
    return F.pad(q.view(torch.uint8), (0, 0, 0, pad)).view(q.dtype) if pad else q


def _outer_dim_major(s: torch.Tensor) -> torch.Tensor:
    """`s` with strides exactly (1, rows), which ATen checks (`contiguous()` would pass a size-1 dim's other stride,
    e.g. a row slice of a taller scale tensor, as one token block of stacked siblings' dYᵀ has)."""
    if s.stride() == (1, s.shape[0]):
        return s
    return torch.empty_strided(s.shape, (1, s.shape[0]), dtype=s.dtype, device=s.device).copy_(s)


def cublas_operands(
    a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor, b_block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object, torch.Tensor, object]:
    """`(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b)` for `F.scaled_mm` computing `A @ B.T` (A (M, K) in
    1x128 blocks, B (N, K) in `b_block` blocks), padded only where the inputs miss the layout rules above. `mat_a`
    may have more rows than A and `mat_b` more columns than B has rows (zero padding): the GEMM's extra output rows
    and columns are the caller's to drop."""
    if tuple(b_block) not in ((128, 128), (1, 128)):
        raise ValueError(
            f"the torch backend takes 128x128 or 1x128 blocks for B, got {tuple(b_block)}; use 'emulated'"
        )
    a, b = _pad_k(a.contiguous()), _pad_k(b.contiguous())
    pad_m = -a.shape[0] % 4
    if pad_m:
        a = _pad_rows(a, 4)
        a_scale_inv = F.pad(a_scale_inv, (0, 0, 0, pad_m), value=1.0)
    scale_a = _outer_dim_major(a_scale_inv.float())
    if tuple(b_block) == (128, 128):
        b = _pad_rows(b, 128)  # its scales already have ceil(N / 128) rows
        pad_kb = -b_scale_inv.shape[1] % 4
        scale_b = F.pad(b_scale_inv.float(), (0, pad_kb), value=1.0) if pad_kb else b_scale_inv.float()
        scale_b, recipe_b = scale_b.contiguous().t(), F.ScalingType.BlockWise128x128
    else:
        scale_b, recipe_b = _outer_dim_major(b_scale_inv.float()), F.ScalingType.BlockWise1x128
    return a, b.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b, recipe_b


def gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`A @ B.T` for A (M, K) in 1x128 blocks and B (N, K) in `b_block` blocks along K -> (M, N) in `out_dtype`."""
    m, n = a.shape[0], b.shape[0]
    mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b = cublas_operands(a, a_scale_inv, b, b_scale_inv, b_block)
    out = F.scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=out_dtype)
    return out[:m] if out.shape[1] == n else out[:m, :n].contiguous()
