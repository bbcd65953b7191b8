"""The `triton` backend: trl-fp8's own block-scaled FP8 GEMM and fused quantization kernels in Triton
(`triton_gemm_kernels.py`, `triton_kernels.py`), for Hopper GPUs where `F.scaled_mm`'s blockwise kernel is missing or
slower. Tested against `emulated` on the same FP8 operands."""

import torch

from ._quantize import fast_act as quantize_act
from ._quantize import fast_act_columns as quantize_act_columns
from ._quantize import fast_weight as quantize_weight
from ._quantize import fast_weight_rows as quantize_weight_rows
from ._quantize import interpreting, triton_status


name = "triton"
__all__ = ["gemm", "is_available", "quantize_act", "quantize_act_columns", "quantize_weight", "quantize_weight_rows"]


def is_available(device: torch.device | None = None) -> tuple[bool, str]:
    ok, why = triton_status()
    if ok and device is not None and device.type != "cuda" and not interpreting():
        return False, f"tensors on {device}; the Triton kernels need CUDA tensors"
    return ok, why


def gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`A @ B.T` for A (M, K) in 1x128 blocks and B (N, K) in `b_block` blocks along K -> (M, N) in `out_dtype`."""
    from .triton_gemm_kernels import gemm as triton_gemm

    return triton_gemm(a, a_scale_inv, b, b_scale_inv, b_block, out_dtype)
