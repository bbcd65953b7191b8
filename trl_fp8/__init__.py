"""trl-fp8: end-to-end FP8 reinforcement learning for Hugging Face TRL."""

__version__ = "0.1.0.dev0"

from .quant import FP8Linear, convert_to_fp8, dequantize_blockwise, iter_fp8_state, quantize_blockwise
from .recipe import FP8Recipe
from .trainers import FP8GRPOConfig, FP8GRPOTrainer


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
