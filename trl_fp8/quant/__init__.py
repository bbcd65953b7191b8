"""All of trl-fp8's numerics, as pure functions and plain modules; nothing here knows about TRL.

One scale convention everywhere (TransformerEngine's): `scale` multiplies a high-precision tensor into FP8,
`scale_inv = 1 / scale` dequantizes (`x ≈ q.float() * scale_inv`) and is what GEMMs and checkpoints carry
(`weight_scale_inv`). A reciprocal is never called `scale`, except where others chose the name: vLLM's
`k_scale` / `v_scale` / `q_scale` and `F.scaled_mm`'s `scale_a` / `scale_b` are dequant multipliers.
"""

from .blockwise import FP8_DTYPE, FP8_MAX, dequantize_blockwise, quantize_blockwise, scale_from_amax
from .convert import convert_to_fp8, fp8_modules, select_fp8_linears
from .export import iter_fp8_state, stream_nbytes
from .linear import FP8Linear
from .staleness import mark_weights_changed, weights_epoch
from .w8a8 import W8A8Linear, quantize_per_token_group


def __getattr__(name: str):
    # FP8 + LoRA needs PEFT; the rest of the numerics (and the GPU benchmark's machine) do not.
    if name in ("FP8LoraLinear", "convert_lora_layers"):
        from . import lora

        return getattr(lora, name)
    raise AttributeError(f"module 'trl_fp8.quant' has no attribute {name!r}")


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8Linear",
    "FP8LoraLinear",
    "W8A8Linear",
    "convert_lora_layers",
    "convert_to_fp8",
    "dequantize_blockwise",
    "fp8_modules",
    "iter_fp8_state",
    "mark_weights_changed",
    "quantize_blockwise",
    "quantize_per_token_group",
    "scale_from_amax",
    "select_fp8_linears",
    "stream_nbytes",
    "weights_epoch",
]
