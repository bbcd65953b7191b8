"""What every sampling engine receives from the learner after an optimizer step: the export stream
(`trl_fp8.quant.export`), plus, with an FP8 KV cache, per-layer Q/K/V scales recalibrated from the updated learner.
Shared by the reference engine and the vLLM engine, so both are refitted with exactly the same tensors."""

import time

import torch
from torch import nn
from trl.distributed import DistributedBackend

from ..quant.adapters import adapter_state, unwrap_peft
from ..quant.export import iter_fp8_state, iter_hp_state, persistent_buffers
from ..quant.kv_cache import (
    attention_module_names,
    calibrate_kv_scales,
    check_kv_cache_supported,
)
from ..quant.staleness import serial, weights_epoch
from .gather import learner_gather


class LearnerStream:
    """Mixin: builds the learner's stream for an engine. Call `_init_stream` in the engine's `__init__`."""

    def _init_stream(
        self, model, accelerator, recipe, *, fp8: bool, kv_cache: bool, kv_scale_percentile: float, kv_scale_margin
    ) -> None:
        if kv_cache:
            check_kv_cache_supported(unwrap_peft(accelerator.unwrap_model(model)))
        self.model, self.accelerator, self.recipe, self.fp8 = model, accelerator, recipe, fp8
        self.kv_cache, self.kv_scale_percentile, self.kv_scale_margin = kv_cache, kv_scale_percentile, kv_scale_margin
        # Set by the trainer: `(input_ids, attention_mask)` of a small slice of the latest batch.
        self.calibration_batch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.recalibrate = True  # False keeps the first calibration forever (for measuring what stale scales cost)
        self._kv_scale_invs: torch.Tensor | None = None
        self._attn_names = attention_module_names(self.learner()) if kv_cache else []
        self._synced_versions: tuple | None = None
        self.last_sync: dict[str, float] | None = None
        # DeepSpeed ZeRO-3 and FSDP2 shard the learner's parameters: the stream gathers each module's while reading
        # it (`learner_gather`); FSDP2 also needs its outermost module to run first (KV calibration).
        self._fsdp2 = DistributedBackend(accelerator).fsdp_version == 2

    def learner(self) -> nn.Module:
        """The learner as a transformers model, in the checkpoint's module names (no DDP or PEFT wrapper)."""
        return unwrap_peft(self.accelerator.unwrap_model(self.model))

    def learner_changed(self) -> tuple | None:
        """The learner's weight versions if they changed since the last sync (else `None`): its parameters' and
        those of the buffers the stream carries (a router's `e_score_correction_bias`), so that a change to either
        alone is sent, as is a tensor put in place of another (`serial`)."""
        policy = self.learner()
        versions = (
            weights_epoch(),
            adapter_state(policy),
            *((serial(p), p._version) for p in policy.parameters()),
            *(b._version for _, b in persistent_buffers(policy)),  # a detached view shares the counter
        )
        return None if versions == self._synced_versions else versions

    def state_stream(self, kv_scale_invs: torch.Tensor | None = None) -> list[tuple[str, torch.Tensor]]:
        """What the learner sends: block-FP8 pairs for an FP8 sampler, its own tensors for a high-precision one; with
        an FP8 KV cache, the Q/K/V scales `kv_scale_invs` (by default those the sampler holds)."""
        policy = self.learner()
        with learner_gather(self.accelerator, self.model) as gather:
            if not self.fp8:
                return list(iter_hp_state(policy, gather=gather))
            # A converted learner sends its own cached quantization; an unconverted one is quantized by the recipe.
            converted = getattr(policy, "fp8_recipe", None) is not None
            pairs = list(iter_fp8_state(policy, None if converted else self.recipe, gather=gather))
        if self.kv_cache:
            scale_invs = self._kv_scale_invs if kv_scale_invs is None else kv_scale_invs
            if scale_invs is None:
                raise RuntimeError("FP8 KV cache: no Q/K/V scales yet; sync_weights() calibrates them first")
            pairs += self._kv_scale_pairs(scale_invs)
        return pairs

    def _kv_scale_pairs(self, scale_invs: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        pairs = []
        for name, (k, v, q) in zip(self._attn_names, scale_invs, strict=True):
            pairs += [(f"{name}.k_scale", k), (f"{name}.v_scale", v), (f"{name}.q_scale", q)]
        return pairs

    def checkpoint_kv_scales(self) -> list[tuple[str, torch.Tensor]]:
        """The Q/K/V scales an FP8 checkpoint of the learner's current weights carries, named as the stream names
        them (vLLM serving it with `kv_cache_dtype="fp8"` reads them; without them it takes 1.0): measured now on
        the latest calibration batch, as the next sync would, without touching what the sampler holds. The
        sampler's own scales if recalibration is off or there is no batch yet; none before any calibration.
        Collective with several ranks, as `calibrate_kv_scales`."""
        if not self.kv_cache:
            return []
        if self.recalibrate and self.calibration_batch is not None:
            return self._kv_scale_pairs(self._measure_kv_scales())
        return [] if self._kv_scale_invs is None else self._kv_scale_pairs(self._kv_scale_invs)

    @torch.no_grad()
    def calibrate_kv_scales(self) -> float:
        """Recomputes the Q/K/V scales the next syncs send with the learner's current weights; returns the seconds it
        took."""
        start = time.perf_counter()
        self._kv_scale_invs = self._measure_kv_scales()
        return time.perf_counter() - start

    @torch.no_grad()
    def _measure_kv_scales(self) -> torch.Tensor:
        if self.calibration_batch is None:
            raise RuntimeError("FP8 KV cache: set `calibration_batch` (input_ids, attention_mask) before syncing")
        policy = self.learner()
        # The device it computes on: an offloaded learner's parameters stay on the CPU between uses.
        ids, mask = (t.to(self.accelerator.device) for t in self.calibration_batch)
        # FSDP2 unshards the embeddings in its outermost module's forward, which must run first.
        model = self.model if self._fsdp2 else policy.get_decoder()
        scale_invs = calibrate_kv_scales(
            model, ids, mask, percentile=self.kv_scale_percentile, margin=self.kv_scale_margin
        )
        if self.accelerator.num_processes > 1:  # every rank's sampler must hold the same scales
            scale_invs = self.accelerator.reduce(scale_invs.to(self.accelerator.device), reduction="max").cpu()
        return scale_invs

    def _sync_kv_scales(self) -> tuple[torch.Tensor | None, float]:
        """The Q/K/V scales a sync sends, measured anew (or first) but not yet held: the sync holds them once they
        loaded (a refused stream must leave none behind, which `recalibrate=False` would keep for good); `None` for
        the held ones. With the seconds it took."""
        if self.kv_cache and (self.recalibrate or self._kv_scale_invs is None):
            start = time.perf_counter()
            return self._measure_kv_scales(), time.perf_counter() - start
        return None, 0.0

    def _hold_kv_scales(self, scale_invs: torch.Tensor | None) -> None:
        if scale_invs is not None:
            self._kv_scale_invs = scale_invs
