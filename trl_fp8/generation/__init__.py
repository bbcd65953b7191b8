"""Sampling engines behind TRL's engine interface (`sync_weights()`, `generate()` -> ids + per-token log-probs)."""

from .reference import ReferenceEngine, build_sampler_model


__all__ = ["ReferenceEngine", "build_sampler_model"]
