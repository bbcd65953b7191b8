"""trl-fp8: end-to-end FP8 reinforcement learning for Hugging Face TRL."""

__version__ = "0.1.0.dev0"

from .quant import FP8Linear, convert_to_fp8, dequantize_blockwise, iter_fp8_state, quantize_blockwise
from .recipe import FP8Recipe


def __getattr__(name: str):
    # The trainers import TRL; the numerics (and the GPU benchmark) must not need it.
    if name in ("FP8GRPOConfig", "FP8GRPOTrainer"):
        from . import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module 'trl_fp8' has no attribute {name!r}")


__all__ = [
    "FP8GRPOConfig",
    "FP8GRPOTrainer",
    "FP8Linear",
    "FP8Recipe",
    "convert_to_fp8",
    "dequantize_blockwise",
    "iter_fp8_state",
    "quantize_blockwise",
]
