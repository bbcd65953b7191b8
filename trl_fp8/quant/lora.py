"""FP8 + LoRA: PEFT LoRA adapters over FP8 linears, trained on the very weight grid the sampler receives.

PEFT's `lora.Linear` adds the adapter's product to its base layer's output, `Y = X·Q(W)ᵀ + s·X·Aᵀ·Bᵀ`. A sampler,
vLLM or the reference engine, holds one weight per layer: the merged `W + s·B·A`, in block FP8 `Q(W + s·B·A)`. The
two differ by how the adapter's delta falls on the FP8 grid, which is the FP8-generation-only mismatch the recipe
exists to remove. An `FP8LoraLinear` therefore runs the merged weight itself (M tokens, K in, N out, rank r):

- fprop: Y[M, N]   = X[M, K] · Q(W + s·B·A)[N, K]ᵀ     FP8, the quantization the sampler receives bit for bit
- dgrad: dX[M, K]  = dY[M, N] · Q(W + s·B·A)[N, K]     FP8
- wgrad: dW'[N, K] = dY[M, N]ᵀ · X[M, K]               FP8, as in full-parameter training; autograd carries it
  through the merge to dB[N, r] = s·dW'·Aᵀ and dA[r, K] = s·Bᵀ·dW' (W is frozen: no gradient, no optimizer state)

Quantization is the identity in backward (straight-through), as in every FP8 linear. This costs the wgrad GEMM that
a plain LoRA skips; what LoRA keeps is its memory saving (no gradient or optimizer state for W) and its small
checkpoints. The merged weight is quantized once per optimizer step (cached on the versions of W, A and B).

Supported: vanilla LoRA on linears (any rank, alpha, rsLoRA, several adapters active at once, `fan_in_fan_out`),
with `lora_dropout=0` (dropout acts on the adapter's input and cannot be merged into a weight). Refused, naming the
layer: DoRA and the other LoRA variants, `lora_bias`. With adapters disabled (TRL's reference log-probs) or merged,
PEFT's own forward runs, on the FP8 base layer.
"""

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn

from .adapters import lora_layers, merged_weight
from .blockwise import _raise_nonfinite
from .linear import FP8Linear, _FP8LinearFunction, autocast_input, mark_weights_changed, weights_epoch


def check_mergeable(layer: LoraLinear, name: str, *, allow_dropout: bool = False) -> None:
    """Raises a `ValueError` naming the layer and the LoRA option if `layer`'s adapters cannot be merged into one
    weight, what every sampler holds. Dropout only matters to a layer that trains on its merged weight."""
    for adapter in layer.lora_A:
        if not allow_dropout and not isinstance(layer.lora_dropout[adapter], nn.Identity):
            raise ValueError(
                f"{name}: LoraConfig.lora_dropout must be 0 for FP8 + LoRA (adapter {adapter!r}): dropout on the "
                "adapter's input cannot be merged into the weight that the FP8 learner and sampler share"
            )
        if adapter in getattr(layer, "lora_variant", {}):
            variant = type(layer.lora_variant[adapter]).__name__
            raise ValueError(f"{name}: LoRA variant {variant} (adapter {adapter!r}) is not supported for FP8 + LoRA")
        if getattr(layer, "lora_bias", {}).get(adapter):
            raise ValueError(f"{name}: LoraConfig.lora_bias is not supported for FP8 + LoRA (adapter {adapter!r})")


class FP8LoraLinear(LoraLinear):
    """PEFT's `lora.Linear` over an `FP8Linear` base, running the merged weight in FP8 (see the module docstring).
    Made by `convert_lora_layers`, which re-classes PEFT's layers in place: it adds no parameters or buffers, so
    names, adapter checkpoints and optimizer states are PEFT's."""

    _fp8_cache: tuple | None = None

    def _adapters(self) -> list[str]:
        return [a for a in self.active_adapters if a in self.lora_A]

    def _fp8_key(self, adapters: list[str]) -> tuple:
        w = self.get_base_layer().weight
        key = [weights_epoch(), w._version, w.data_ptr(), w.dtype, w.device]
        for a in adapters:
            lora_a, lora_b = self.lora_A[a].weight, self.lora_B[a].weight
            key += [a, self.scaling[a], lora_a._version, lora_a.data_ptr(), lora_b._version, lora_b.data_ptr()]
        return tuple(key)

    @torch.inference_mode(False)  # as FP8Linear's cache: autograd must be able to save it
    @torch.no_grad()
    def _quantized(self, check_finite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(Q, scale_inv, Qᵀ, scale_invᵀ)` of the merged weight, made once per optimizer step, with `FP8Linear`'s
        deferred NaN/inf check."""
        base, adapters = self.get_base_layer(), self._adapters()
        key = self._fp8_key(adapters)
        if self._fp8_cache is None or self._fp8_cache[0] != key:
            w = merged_weight(self, adapters)
            backend = base._backend_for(w.device)
            q, s, amax = backend.quantize_weight(
                w, base.weight_block_size, base.pow2_scales, f"{base.fp8_name} + LoRA", check_finite=False
            )
            transposed = (q.t().contiguous(), s.t().contiguous()) if w.is_cuda else (q.t(), s.t())
            self._fp8_cache = (key, q, s, *transposed, amax)
        amax = self._fp8_cache[5]
        if check_finite and amax is not None:
            if not bool(torch.isfinite(amax).all()):  # one host sync per export, none per forward
                _raise_nonfinite(merged_weight(self, adapters), f"{base.fp8_name} + LoRA")
            self._fp8_cache = (*self._fp8_cache[:5], None)
        return self._fp8_cache[1:5]

    @torch.no_grad()
    def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(Q(W + s·B·A), scale_inv)`: what this layer computes with, and what the sampler receives. Raises a
        `ValueError` naming the layer if the merged weight holds NaN or inf."""
        if not self._fp8_path():
            raise RuntimeError(f"{self.get_base_layer().fp8_name}: adapters are disabled, merged or absent")
        q, s, _, _ = self._quantized(check_finite=True)
        return q, s

    def _fp8_path(self) -> bool:
        return not (self.disable_adapters or self.merged) and bool(self._adapters())

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not self._fp8_path() or kwargs.get("adapter_names") is not None:
            return super().forward(x, *args, **kwargs)  # the FP8 base layer alone, or PEFT's mixed batches
        base, adapters = self.get_base_layer(), self._adapters()
        q, s, qt, st = self._quantized(check_finite=False)
        trains = torch.is_grad_enabled() and any(
            p.requires_grad for a in adapters for p in (self.lora_A[a].weight, self.lora_B[a].weight)
        )
        # The merged weight enters autograd only for its gradient: the GEMMs read the cached quantization.
        weight = merged_weight(self, adapters) if trains else base.weight
        return _FP8LinearFunction.apply(
            autocast_input(x),
            weight,
            base.bias,
            q,
            s,
            qt,
            st,
            base.weight_block_size,
            base._backend_for(x.device),
            base.pow2_scales,
            torch.is_grad_enabled(),
        )

    # PEFT merges through `weight.data`, which no version counter sees: the FP8 caches must be told.
    def merge(self, *args, **kwargs) -> None:
        super().merge(*args, **kwargs)
        mark_weights_changed()

    def unmerge(self) -> None:
        super().unmerge()
        mark_weights_changed()

    def __getstate__(self):
        return {**self.__dict__, "_fp8_cache": None}


def convert_lora_layers(model: nn.Module) -> list[str]:
    """Re-classes, in place, PEFT's `lora.Linear` layers whose base layer is an `FP8Linear` as `FP8LoraLinear`;
    returns their names. Every adapter layer is checked first, so an unsupported one raises before anything
    changes."""
    check_peft_supported(model)
    layers = lora_layers(model)
    converted = []
    for name, m in layers.items():
        if type(m) is LoraLinear and isinstance(m.get_base_layer(), FP8Linear):
            m.__class__ = FP8LoraLinear
            converted.append(name)
    return converted


def check_peft_supported(model: nn.Module, *, allow_dropout: bool = False) -> None:
    """Raises a `ValueError` naming the module if `model` holds PEFT parts the FP8 stream cannot carry: adapters
    other than LoRA on linears, or LoRA that cannot be merged (see `check_mergeable`), `modules_to_save` /
    trainable-token wrappers."""
    for name, m in model.named_modules():
        if isinstance(m, AuxiliaryTrainingWrapper):
            raise ValueError(
                f"{name}: {type(m).__name__} (LoraConfig.modules_to_save / trainable_token_indices) is not supported "
                "with FP8 yet; train those modules' copies without FP8, or leave them out of the adapter"
            )
    for name, m in lora_layers(model).items():
        if not isinstance(m, LoraLinear):
            raise ValueError(f"{name}: {type(m).__name__} adapters are not supported with FP8 (LoRA on linears is)")
        check_mergeable(m, name, allow_dropout=allow_dropout)
