"""The `emulated` backend: dequantize both operands, multiply in fp32. Runs anywhere; the oracle for every other
backend. It differs from a real kernel, which multiplies the FP8 codes exactly and scales each block's partial sum,
in the accumulation order and in rounding each dequantized value `q * scale_inv` to fp32 (exact for pow2 scales):
errors near fp32's 2**-24, far below FP8's."""

import torch

from ..blockwise import dequantize_blockwise
from ._quantize import reference_act as quantize_act
from ._quantize import reference_act_columns as quantize_act_columns
from ._quantize import reference_weight as quantize_weight
from ._quantize import reference_weight_rows as quantize_weight_rows


name = "emulated"
__all__ = ["gemm", "is_available", "quantize_act", "quantize_act_columns", "quantize_weight", "quantize_weight_rows"]


def is_available(device: torch.device | None = None) -> tuple[bool, str]:
    return True, "runs on any device"


def gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_block: tuple[int, int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`A @ B.T` for A (M, K) in 1x128 blocks and B (N, K) in `b_block` blocks along K -> (M, N) in `out_dtype`."""
    a_hp = dequantize_blockwise(a, a_scale_inv, (1, 128))
    b_hp = dequantize_blockwise(b, b_scale_inv, b_block)
    # A surrounding autocast (Trainer's bf16 on CPU) would run this matmul in bf16: the oracle accumulates in fp32.
    with torch.autocast(a.device.type, enabled=False):
        return (a_hp @ b_hp.t()).to(out_dtype)
