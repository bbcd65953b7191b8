"""PEFT adapter layers as the rest of trl-fp8 sees them: the plain linear each stands for, and the weight it computes
with. Nothing here imports PEFT (the GPU benchmark's machine has none): a model can hold PEFT layers only once PEFT
is imported, and the layers are read through the attributes of PEFT's `LoraLayer`. The FP8 layer itself, which
needs PEFT, is in `trl_fp8.quant.lora`."""

import sys

import torch
from torch import nn

from .linear import FP8Linear


def _peft():
    return sys.modules.get("peft")


def merged_weight(layer, adapters: list[str] | None = None) -> torch.Tensor:
    """`W + Σ s·B·A` over `adapters` (the active ones by default), in W's dtype, as PEFT's merge computes it
    (`merge_and_unload()`): each adapter's delta added in the wider of the two dtypes, then rounded once to W's (fp32
    adapters over a bf16 base: not the delta rounded to bf16 first, as `safe_merge=True` does); differentiable with
    respect to the adapters."""
    w = layer.get_base_layer().weight
    for name in layer.active_adapters if adapters is None else adapters:
        if name in layer.lora_A:
            w = (w + layer.get_delta_weight(name)).to(w.dtype)
    return w


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT's adapter layers of `model`, by name."""
    if _peft() is None:
        return {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def effective_weight(layer) -> torch.Tensor:
    """The high-precision weight `layer` computes with: W + s·B·A over its active adapters; W alone when they are
    disabled, or already merged into it."""
    off = layer.disable_adapters or layer.merged
    return merged_weight(layer, [] if off else None).detach()


def fp8_weight(layer, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(q, scale_inv)` that `layer` (named `name`) computes with if it runs in FP8, else None. Raises a `ValueError`
    for adapters that run PEFT's additive forward over an FP8 base (added after `convert_lora_layers`): no single
    FP8 weight is what such a layer computes with."""
    runs_merged = getattr(layer, "_fp8_path", None)  # an FP8LoraLinear
    if runs_merged is not None and runs_merged():
        return layer.quantized_weight()
    base = layer.get_base_layer()
    if not isinstance(base, FP8Linear):
        return None
    if not (layer.disable_adapters or layer.merged) and any(a in layer.lora_A for a in layer.active_adapters):
        raise ValueError(
            f"{name}: its LoRA adapters run PEFT's additive forward over an FP8 base, which no FP8 weight a sampler "
            "can hold reproduces; call trl_fp8.quant.convert_lora_layers(model) after adding adapters"
        )
    return base.quantized_weight()


def adapter_state(model: nn.Module) -> tuple:
    """What, besides parameter values, sets the weights `model`'s LoRA layers compute with: their active adapters,
    whether those are disabled or merged, and their scalings (`set_adapter`, `set_scale` change no parameter)."""
    return tuple(
        (name, tuple(m.active_adapters), m.disable_adapters, m.merged, tuple(sorted(m.scaling.items())))
        for name, m in lora_layers(model).items()
    )


def tied_weights(model: nn.Module) -> dict[int, list[str]]:
    """The parameters of `model` that appear under several names (tied embeddings), by id, with their names."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {key: value for key, value in names.items() if len(value) > 1}


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a `PeftModel`, whose module names are the checkpoint's (`model.layers.0...`,
    the adapter layers where their linears were); any other model as it is."""
    peft = _peft()
    return model.get_base_model() if peft is not None and isinstance(model, peft.PeftModel) else model
