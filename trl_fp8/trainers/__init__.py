from .fp8_grpo_config import FP8GRPOConfig
from .fp8_grpo_trainer import FP8GRPOTrainer


__all__ = ["FP8GRPOConfig", "FP8GRPOTrainer"]
