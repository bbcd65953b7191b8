"""FP8 + LoRA: PEFT LoRA adapters over FP8 linears, trained on the very weight grid the sampler receives.

PEFT's `lora.Linear` adds the adapter's product to its base layer's output, `Y = X·Q(W)ᵀ + s·X·Aᵀ·Bᵀ`. A sampler,
vLLM or the reference engine, holds one weight per layer: the merged `W + s·B·A`, in block FP8 `Q(W + s·B·A)`. The
two differ by how the adapter's delta falls on the FP8 grid, which is the FP8-generation-only mismatch the recipe
exists to remove. An `FP8LoraLinear` therefore computes with the merged weight itself (see `_FP8LoraFunction` for
its GEMMs): forward and dgrad in FP8 on `Q(W + s·B·A)`, quantized once per optimizer step (cached on the versions of
W, A and B); the adapters' gradients in high precision from X and dY, as PEFT computes them. Those are the
straight-through gradients of the merged layer (quantization is the identity in backward, as in every FP8 linear),
without the N x K weight gradient that full training needs: W is frozen, with no gradient and no optimizer state.

Supported: vanilla LoRA on linears (any rank, alpha, rsLoRA, several adapters active at once), with
`lora_dropout=0` (dropout acts on the adapter's input and cannot be merged into a weight). Refused, naming the
layer: DoRA and the other LoRA variants, `lora_bias`. With adapters disabled (TRL's reference log-probs) or merged,
PEFT's own forward runs, on the FP8 base layer.
"""

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn

from .adapters import lora_layers, merged_weight, tied_weights
from .blockwise import _raise_nonfinite
from .linear import (
    FP8Linear,
    _SharedActivation,
    as_output,
    autocast_input,
    first_order_only,
    is_sharded,
)
from .staleness import mark_weights_changed, serial, weights_epoch


class _FP8LoraFunction(torch.autograd.Function):
    """Y = X · Q(W + B·A)ᵀ (+ b) for a frozen W and the active adapters stacked, A (r, K) and B (N, r) with their
    scalings folded into B (M tokens, K in, N out, r the adapters' summed rank):

    - fprop: Y[M, N]  = X[M, K] · Q(W + B·A)[N, K]ᵀ      FP8: X in 1x128 blocks along K, the merged weight in 128x128
    - dgrad: dX[M, K] = dY[M, N] · Q(W + B·A)[N, K]      FP8: dY in 1x128 blocks along N (for a sharded W: merged and
      quantized again here, from the weights DeepSpeed or FSDP gathers again for the backward, the same bits)
    - the adapters, in high precision (fp32 accumulation) from the saved X and dY, instead of a wgrad:
      dB[N, r] = dY[M, N]ᵀ · (X·Aᵀ)[M, r]    and    dA[r, K] = (dY·B)[M, r]ᵀ · X[M, K]

    The merged weight's FP8 codes and scales are passed in (the layer's cache), so the sampler's are these very ones.
    Given `layer` (a sharded base weight), its transposes are not kept for the backward, which asks the layer again.
    """

    @staticmethod
    def forward(
        ctx, x, lora_a, lora_b, bias, w_fp8, w_scale_inv, w_fp8_t, w_scale_inv_t, w_block, backend, pow2, layer=None
    ):
        x2d = x.reshape(-1, x.shape[-1])
        m = x2d.shape[0]
        x_fp8, x_scale_inv, _, _ = _SharedActivation.quantize(backend, x, x2d, pow2, False)
        y = backend.gemm(x_fp8, x_scale_inv, w_fp8, w_scale_inv, w_block, x.dtype)[:m]
        if bias is not None:
            y = y + bias.to(y.dtype)
        # A sharded weight's FP8 transpose is not kept from forward to backward: a whole FP8 copy of every layer.
        ctx.layer = layer
        keep = (None, None) if layer is not None else (w_fp8_t, w_scale_inv_t)
        ctx.save_for_backward(*keep, x2d, lora_a, lora_b)
        ctx.backend, ctx.pow2_scales, ctx.w_block, ctx.x_shape = backend, pow2, w_block, x.shape
        ctx.has_bias = bias is not None
        return as_output(y.reshape(*x.shape[:-1], y.shape[-1]))

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        w_fp8_t, w_scale_inv_t, x2d, lora_a, lora_b = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        m = dy2d.shape[0]
        dx = da = db = dbias = None
        if ctx.needs_input_grad[0]:
            if ctx.layer is not None:
                _, _, w_fp8_t, w_scale_inv_t = ctx.layer._quantized(check_finite=False)
            dy_fp8, dy_scale_inv, _, _ = ctx.backend.quantize_act(dy2d, ctx.pow2_scales, False)
            w_block_t = (ctx.w_block[1], ctx.w_block[0])
            dx = ctx.backend.gemm(dy_fp8, dy_scale_inv, w_fp8_t, w_scale_inv_t, w_block_t, x2d.dtype)
            dx = dx[:m].reshape(ctx.x_shape)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dy_hp, x_hp = dy2d.to(lora_a.dtype), x2d.to(lora_a.dtype)
            if ctx.needs_input_grad[2]:
                db = dy_hp.t() @ (x_hp @ lora_a.t())  # [N, M] @ [M, r] -> [N, r]
            if ctx.needs_input_grad[1]:
                da = (dy_hp @ lora_b).t() @ x_hp  # [r, M] @ [M, K] -> [r, K]
        if ctx.has_bias and ctx.needs_input_grad[3]:
            dbias = dy2d.sum(0)
        return dx, da, db, dbias, None, None, None, None, None, None, None, None


def check_mergeable(
    layer: LoraLinear, name: str, *, allow_dropout: bool = False, adapters: list[str] | None = None
) -> None:
    """Raises a `ValueError` naming the layer and the LoRA option if `layer`'s adapters (all, or those named) cannot
    be merged into one weight, what every sampler holds. Dropout only matters to a layer that trains on its merged
    weight."""
    for adapter in layer.lora_A if adapters is None else adapters:
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
        base = self.get_base_layer()
        w = base.weight
        key = [weights_epoch(), base.backend, base.weight_block_size, base.pow2_scales]
        key += [serial(w), w._version, w.data_ptr(), w.dtype, w.device]
        for a in adapters:
            lora_a, lora_b = self.lora_A[a].weight, self.lora_B[a].weight
            key += [a, self.scaling[a], *(k for t in (lora_a, lora_b) for k in (serial(t), t._version, t.data_ptr()))]
        return tuple(key)

    def _quantized(
        self, check_finite: bool, with_t: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`(Q, scale_inv, Qᵀ, scale_invᵀ)` of the merged weight, made once per optimizer step, with `FP8Linear`'s
        deferred NaN/inf check. The transposes are `None` for a sharded weight without `with_t` (its forward needs
        none: its backward asks again)."""
        base, entry = self.get_base_layer(), self._fp8_cache
        # A hit, as FP8Linear's: no grad-mode switches (a cached entry is never a sharded weight's, and has Qᵀ).
        hit = entry is not None and (not check_finite or entry[5] is None) and not is_sharded(base.weight, base)
        if hit and entry[0] == self._fp8_key(self._adapters()):
            return entry[1:5]
        return self._quantize_merged(check_finite, with_t)

    @torch.inference_mode(False)  # as FP8Linear's cache: autograd must be able to save it
    @torch.no_grad()
    def _quantize_merged(
        self, check_finite: bool, with_t: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        base, adapters = self.get_base_layer(), self._adapters()
        key, sharded = self._fp8_key(adapters), is_sharded(base.weight, base)
        entry = self._fp8_cache
        if sharded or entry is None or entry[0] != key:
            # `convert_lora_layers` checked the adapters it saw; one PEFT adds later (`add_adapter`) joins this very
            # layer, and its dropout or variant would be dropped silently by the merged weight.
            check_mergeable(self, base.fp8_name.removesuffix(".weight"), adapters=adapters)
            # Merged in the weights' own precision under any autocast (the forward's, none in the backward or the
            # export): one bit pattern for all of them.
            with torch.autocast(base.weight.device.type, enabled=False):
                w = merged_weight(self, adapters)
            backend = base._backend_for(w.device)
            keep_t = not sharded or with_t
            q, s, qt, st, amax = backend.quantize_weight(
                w,
                base.weight_block_size,
                base.pow2_scales,
                f"{base.fp8_name} + LoRA",
                check_finite=False,
                with_t=keep_t and w.is_cuda,
            )
            entry = (key, q, s, *((qt, st) if keep_t else (None, None)), amax)
        if check_finite and entry[5] is not None:
            if not bool(torch.isfinite(entry[5]).all()):  # one host sync per export, none per forward
                _raise_nonfinite(merged_weight(self, adapters), f"{base.fp8_name} + LoRA")
            entry = (*entry[:5], None)
        if not sharded:  # as FP8Linear's: no cache of a sharded weight
            self._fp8_cache = entry
        return entry[1:5]

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
        if base.weight.requires_grad and torch.is_grad_enabled():
            # The merged layer has no N x K weight gradient (see `_FP8LoraFunction`): W would silently get none.
            raise RuntimeError(
                f"{base._where()}: its base weight is trainable (requires_grad=True), but an FP8 LoRA layer computes "
                "no gradient for it (it trains only the adapters, on the merged weight): freeze the base weight"
            )
        sharded = is_sharded(base.weight, base)
        q, s, qt, st = self._quantized(check_finite=False, with_t=not sharded)
        # The adapters stacked, their scalings folded into B: autograd takes the gradients on to each A and B.
        lora_a = torch.cat([self.lora_A[a].weight for a in adapters])
        lora_b = torch.cat([self.lora_B[a].weight * self.scaling[a] for a in adapters], dim=1)
        return _FP8LoraFunction.apply(
            autocast_input(x, f"{base._where()} + LoRA"),
            lora_a,
            lora_b,
            base.bias,
            q,
            s,
            qt,
            st,
            base.weight_block_size,
            base._backend_for(x.device),
            base.pow2_scales,
            self if sharded else None,
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

    def _apply(self, fn, recurse=True):
        self._fp8_cache = None  # as FP8Linear's: after `.to()` the key may match a weight that changed
        return super()._apply(fn, recurse)


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
    tied = tied_weights(model)
    for name, m in lora_layers(model).items():
        if not isinstance(m, LoraLinear):
            raise ValueError(f"{name}: {type(m).__name__} adapters are not supported with FP8 (LoRA on linears is)")
        check_mergeable(m, name, allow_dropout=allow_dropout)
        shared = tied.get(id(m.get_base_layer().weight))
        if shared is not None:
            raise ValueError(
                f"{name}: LoRA on a weight tied to another ({', '.join(shared)}) is not supported: the sampler holds "
                "one tensor for both names, and only one of them would carry the adapter. Leave it out of "
                "target_modules, or untie the weights."
            )
