"""The `torch` backend: PyTorch's native block-scaled FP8 GEMM, `torch.nn.functional.scaled_mm` with
`BlockWise1x128` x `BlockWise128x128` (or `BlockWise1x128`) scales, on Hopper (SM90) with CUDA >= 12.9.

Layout rules of the cuBLAS kernel behind it: `mat_b` is column-major (pass `B.t()` of a row-major B), 1x128 scales
are (rows, K/128) and outer-dim-major (`s.t().contiguous().t()`), 128x128 scales are (N/128, K/128) padded to a
multiple of 4 along K/128 and passed transposed; K is padded here to whole 128-blocks (zeros add nothing), and M
to a multiple of 4. Quantization runs in the fused Triton kernels where Triton is installed.
"""

import torch
import torch.nn.functional as F

from ._quantize import fast_act as quantize_act
from ._quantize import fast_weight as quantize_weight


name = "torch"
__all__ = ["gemm", "is_available", "quantize_act", "quantize_weight"]


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


def _pad_k(q: torch.Tensor, scale_inv: torch.Tensor, block_k: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    pad = -q.shape[-1] % block_k
    if pad:
        q = F.pad(q.view(torch.uint8), (0, pad)).view(q.dtype)
    return q, scale_inv


def _outer_dim_major(s: torch.Tensor) -> torch.Tensor:
    return s.t().contiguous().t()


def gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`A @ B.T` for A (M, K) in 1x128 blocks and B (N, K) in `b_block` blocks along K -> (M, N) in `out_dtype`."""
    if tuple(b_block) not in ((128, 128), (1, 128)):
        raise ValueError(
            f"the torch backend takes 128x128 or 1x128 blocks for B, got {tuple(b_block)}; use 'emulated'"
        )
    m = a.shape[0]
    a, _ = _pad_k(a.contiguous(), a_scale_inv)
    b, _ = _pad_k(b.contiguous(), b_scale_inv)
    pad_m = -m % 4
    if pad_m:
        a = F.pad(a.view(torch.uint8), (0, 0, 0, pad_m)).view(a.dtype)
        a_scale_inv = F.pad(a_scale_inv, (0, 0, 0, pad_m), value=1.0)
    scale_a = _outer_dim_major(a_scale_inv.float())
    if tuple(b_block) == (128, 128):
        kb = b_scale_inv.shape[1]
        scale_b = F.pad(b_scale_inv.float(), (0, -kb % 4), value=1.0).contiguous().t()
        recipe_b = F.ScalingType.BlockWise128x128
    else:
        scale_b = _outer_dim_major(b_scale_inv.float())
        recipe_b = F.ScalingType.BlockWise1x128
    out = F.scaled_mm(a, b.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b, recipe_b, output_dtype=out_dtype)
    return out[:m]
