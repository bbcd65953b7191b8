"""Sampling engines behind TRL's engine interface (`sync_weights()`, `generate()` -> ids + per-token log-probs)."""

from .reference import ReferenceEngine, build_sampler_model
from .vllm_fp8 import FP8VLLMGeneration


__all__ = ["FP8VLLMGeneration", "ReferenceEngine", "build_sampler_model"]
