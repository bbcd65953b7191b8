"""`convert_to_fp8(model, recipe)`: swap the decoder blocks' linears for `FP8Linear` (and fused MoE experts for
`FP8Experts`), in place, names unchanged.

Only `nn.Linear` modules inside the text decoder's blocks (`...layers.{i}...`, found with transformers'
`get_decoder()`, so that a multimodal model's vision tower stays in high precision) are candidates. Never converted:
`lm_head`, embeddings and norms (not linears, or outside the layers), MoE routers (`...mlp.gate`, `...router`),
anything the recipe excludes, and what trl-fp8 cannot run in FP8, which stays in high precision with one warning that
lists it: layers whose dims are not multiples of the weight block (vLLM cannot serve them in block FP8), `nn.Linear`
subclasses with a forward of their own (DeepSeek-V4's block-diagonal `o_a_proj` is not x·Wᵀ), and fused experts in
another layout than transformers' standard one (GPT-OSS's).
"""

import fnmatch
import logging
import re
import warnings

import torch
from torch import nn

from .linear import FP8Linear, full_shape, is_sharded
from .te_linear import is_te_linear, te_linear_class, te_recipe_status, te_status


logger = logging.getLogger(__name__)
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# A router, or the linear a router module holds (HunYuan-MoE's `mlp.gate.wg`, LongCat-Flash's `mlp.router.classifier`).
_ROUTER_RE = re.compile(r"(?:^|\.)(?:gate|router)(?:\.[^.]+)?$")


def is_router(name: str) -> bool:
    """Whether the module `name` is an MoE router (`...mlp.gate`, `...router`) or the linear inside one
    (`...mlp.gate.wg`), which always stays in high precision (some routers also read their linear's `.weight`
    themselves, which in the sampler would be FP8 codes)."""
    return _LAYER_RE.search(name) is not None and _ROUTER_RE.search(name) is not None


def _matches(name: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")
    return name == pattern or name.endswith(f".{pattern}") or f".{pattern}." in f".{name}."


def decoder_layers(model: nn.Module) -> tuple[str | None, int | None]:
    """`(prefix, count)` of the text decoder's block list (`"model.layers"`, `"model.language_model.layers"` in
    multimodal models, whose vision tower has `layers` too), from transformers' `get_decoder()`; `(None, None)` for
    a model that does not say, whose blocks are then any `...layers.{i}`."""
    get_decoder = getattr(model, "get_decoder", None)
    try:
        decoder = get_decoder() if callable(get_decoder) else None
    except Exception:  # not every model implements it
        decoder = None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return None, None
    for name, module in model.named_modules():
        if module is layers:
            return name, len(layers)
    return None, None


def layer_of(name: str, prefix: str | None) -> int | None:
    """The decoder block index of module `name`, or None outside the decoder's blocks."""
    if prefix is not None:
        if not name.startswith(f"{prefix}."):
            return None
        name = name[len(prefix) - len("layers") :]
    match = _LAYER_RE.search(name)
    return None if match is None else int(match.group(1))


def named_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """`model`'s linears under their checkpoint names: a PEFT LoRA layer stands for its base linear (under the
    LoRA layer's name, where the plain linear was); its adapters, which stay in high precision, are not listed."""
    from .adapters import lora_layers

    adapted = lora_layers(model)
    inside = tuple(f"{name}." for name in adapted)
    linears = {}
    for name, module in model.named_modules():
        if name.startswith(inside):
            continue
        if name in adapted:
            module = adapted[name].get_base_layer()
        if isinstance(module, nn.Linear):
            linears[name] = module
    return linears


def select_fp8_linears(model: nn.Module, recipe) -> tuple[list[str], list[str]]:
    """Returns `(names to convert, "name (why)" of those the recipe selects but trl-fp8 keeps in high precision)`, in
    module order (checkpoint names: for a PEFT LoRA layer, its own name, standing for its base linear)."""
    prefix, num_layers = decoder_layers(model)
    candidates = []
    for name, module in named_linears(model).items():
        if "lm_head" in name.split("."):
            continue
        layer = layer_of(name, prefix)
        if layer is None or _ROUTER_RE.search(name):
            continue
        candidates.append((name, module, layer))
    if not candidates:
        return [], []
    num_layers = num_layers or _config_layers(model) or max(i for _, _, i in candidates) + 1
    first, last = recipe.num_first_layers_in_bf16, recipe.num_last_layers_in_bf16
    block_n, block_k = recipe.weight_block_size
    selected, kept = [], []
    for name, module, layer in candidates:
        if layer < first or layer >= num_layers - last:
            continue
        if any(_matches(name, p) for p in recipe.modules_to_not_convert):
            continue
        if type(module).forward is not nn.Linear.forward and not isinstance(module, FP8Linear):
            kept.append(f"{name} ({type(module).__name__} has a forward of its own)")
            continue
        if module.out_features % block_n or module.in_features % block_k:
            kept.append(
                f"{name} ({module.out_features}x{module.in_features}, not in whole {block_n}x{block_k} blocks)"
            )
            continue
        selected.append(name)
    return selected, kept


def select_fp8_experts(model: nn.Module, recipe) -> tuple[list[str], list[str]]:
    """Like `select_fp8_linears`, for transformers' fused MoE experts (`gate_up_proj` (E, 2I, H), `down_proj`)."""
    from .moe import FP8Experts, is_fused_experts, unsupported_experts_layout

    prefix, num_layers = decoder_layers(model)
    candidates = [(n, m, layer_of(n + ".", prefix)) for n, m in model.named_modules() if is_fused_experts(m)]
    candidates = [(n, m, layer) for n, m, layer in candidates if layer is not None]
    if not candidates:
        return [], []
    num_layers = num_layers or _config_layers(model) or max(i for _, _, i in candidates) + 1
    selected, kept = [], []
    for name, module, layer in candidates:
        if layer < recipe.num_first_layers_in_bf16 or layer >= num_layers - recipe.num_last_layers_in_bf16:
            continue
        if any(_matches(name, p) for p in recipe.modules_to_not_convert):
            continue
        why = None if isinstance(module, FP8Experts) else unsupported_experts_layout(module)
        if why is not None:
            kept.append(f"{name} ({why})")
            continue
        _, two_i, hidden = full_shape(module.gate_up_proj)
        if list(recipe.weight_block_size) != [128, 128]:
            kept.append(f"{name} (fused experts run with 128x128 weight blocks only, not {recipe.weight_block_size})")
            continue
        if (two_i // 2) % 128 or hidden % 128:
            kept.append(f"{name} (experts {two_i // 2}x{hidden}, not in whole 128x128 blocks)")
            continue
        selected.append(name)
    return selected, kept


def _config_layers(model: nn.Module) -> int | None:
    """The text model's `num_hidden_layers` (multimodal configs keep it in their text config)."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, "num_hidden_layers", None)


def check_fp8_selection(
    model: nn.Module, recipe, warn: bool = True, stacklevel: int = 3
) -> tuple[list[str], list[str]]:
    """What `convert_to_fp8` (or an FP8 sampler built from `model`'s architecture) would put in FP8: raises for a
    model without `...layers.{i}` blocks, and (`warn`) warns of what stays in high precision, naming it, at
    `stacklevel` (3: the line that called this function's caller). Returns `(linears, experts)` selected."""
    prefix, _ = decoder_layers(model)
    if not any(layer_of(name, prefix) is not None for name, _ in model.named_modules()):
        raise ValueError(
            f"trl-fp8 found no decoder blocks in {type(model).__name__}: it converts the linears of blocks named "
            "`...layers.{i}` (Llama, Qwen, Mistral, Gemma, Phi-3, GPT-NeoX, DeepSeek, ...), and this model names "
            "them otherwise (e.g. GPT-2-style `h.{i}`), so nothing would run in FP8."
        )
    selected, kept = select_fp8_linears(model, recipe)
    experts, kept_experts = select_fp8_experts(model, recipe)
    kept += kept_experts
    if warn and kept:
        warnings.warn(
            f"trl-fp8: {len(kept)} layer(s) the recipe selects cannot run in FP8 and stay in high precision: "
            f"{', '.join(kept)}",
            stacklevel=stacklevel,
        )
    names = [name for name, _ in model.named_modules()]
    unmatched = [p for p in recipe.modules_to_not_convert if not any(_matches(name, p) for name in names)]
    if warn and unmatched:
        warnings.warn(
            f"trl-fp8: FP8Recipe.modules_to_not_convert {unmatched} match no module of {type(model).__name__} "
            "(misspelt, or not in this architecture?), so they keep nothing in high precision",
            stacklevel=stacklevel,
        )
    if warn and not selected and not experts:
        warnings.warn(
            f"trl-fp8: the recipe converts none of {type(model).__name__}'s linears (num_first_layers_in_bf16="
            f"{recipe.num_first_layers_in_bf16}, num_last_layers_in_bf16={recipe.num_last_layers_in_bf16}, "
            f"modules_to_not_convert={recipe.modules_to_not_convert}): nothing will run in FP8",
            stacklevel=stacklevel,
        )
    return selected, experts


def convert_to_fp8(
    model: nn.Module, recipe=None, *, sharded: bool = False, device: torch.device | str | None = None
) -> nn.Module:
    """Converts `model`'s decoder-layer linears to `FP8Linear` in place and returns `model`.

    Args:
        model (`nn.Module`):
            A transformers causal LM (or any module whose decoder blocks live under `...layers.{i}.`).
        recipe (`FP8Recipe`, `dict` or path, *optional*):
            The recipe; defaults to `FP8Recipe()`.
        sharded (`bool`, *optional*, defaults to `False`):
            Whether the parameters are (or will be) sharded by DeepSpeed ZeRO-3 or FSDP2: TransformerEngine's
            linears, which copy the weights they are given and cache their own FP8 weights, are then left out
            (`auto` takes trl-fp8's linears; `te` raises), and the FP8 modules are marked (`mark_sharded`).
        device (`torch.device` or `str`, *optional*):
            The device the model will train on, where its parameters are not there yet (DeepSpeed ZeRO-1/2 moves
            them at `train()`): whether TransformerEngine's linears can run is decided for it, and they are built
            there. Defaults to the device of the parameters.

    Parameters, their names and `state_dict` keys are unchanged (the new modules hold the same Parameters).
    Converting an already converted model again with the same recipe is a no-op; with another recipe, or a model
    without `...layers.{i}` blocks, it raises before changing anything. In multimodal models only the text decoder
    (transformers' `get_decoder()`) is converted. With `backend="te"` (or
    `"auto"` on a GPU where TransformerEngine runs the recipe), the linears become TransformerEngine linears
    instead (weights copied, names unchanged); fused MoE experts always use `FP8Experts`. With the recipe's
    `fuse_siblings`, q/k/v then run as one stacked GEMM (`trl_fp8.quant.siblings`).
    """
    from ..recipe import FP8Recipe
    from .moe import FP8Experts

    recipe = FP8Recipe.from_any(recipe)
    previous = getattr(model, "fp8_recipe", None)
    if previous is not None and previous != recipe:
        # Converted modules keep their recipe: mixing two would leave `fp8_recipe` (and what vLLM is told) wrong.
        raise ValueError(
            f"{type(model).__name__} was already converted with {previous}; convert the original model to use {recipe}"
        )
    selected, experts = check_fp8_selection(model, recipe)
    device = None if device is None else torch.device(device)
    te_linear = _te_linear_for(model, recipe, sharded or any(is_sharded(p) for p in model.parameters()), device)
    for name in selected:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, child)
        adapted = not isinstance(module, nn.Linear)
        if adapted:  # a PEFT LoRA layer: its base linear is converted, its adapters not
            parent, child = module, "base_layer"
            module = module.base_layer
        if isinstance(module, FP8Linear) or is_te_linear(module):
            continue
        if te_linear is not None and not adapted:
            new = te_linear.from_linear(module, pow2_scales=recipe.pow2_scales, name=name, device=device)
        else:
            new = FP8Linear.from_linear(
                module,
                # An adapted layer computes with its merged weight through trl-fp8's GEMMs (`FP8LoraLinear`), which
                # TransformerEngine's linear has no way to do.
                backend="auto" if recipe.backend == "te" else recipe.backend,
                pow2_scales=recipe.pow2_scales,
                weight_block_size=tuple(recipe.weight_block_size),
                name=name,
            )
        setattr(parent, child, new)
    for name in experts:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        if not isinstance(module, FP8Experts):
            # TransformerEngine has no grouped-expert module for this layout: experts use trl-fp8's GEMM backends.
            backend = "auto" if recipe.backend == "te" else recipe.backend
            kwargs = dict(backend=backend, pow2_scales=recipe.pow2_scales, name=name)
            setattr(parent, child, FP8Experts(module, **kwargs))
    if recipe.fuse_siblings:
        from .siblings import group_siblings

        group_siblings(model)
    if sharded:
        mark_sharded(model)
    model.fp8_recipe = recipe
    return model


def mark_sharded(model: nn.Module) -> None:
    """Marks `model`'s FP8 linears and experts as holding sharded weights (`trl_fp8.quant.linear.is_sharded`):
    they then quantize their weight at each use, never cache it, and save W rather than its FP8 transpose for the
    backward. FSDP2 needs the mark (the whole weight it swaps in for a forward is a plain tensor); DeepSpeed ZeRO-3's
    parameters carry their own (`ds_id`)."""
    from .moe import FP8Experts

    for m in model.modules():
        if isinstance(m, FP8Linear | FP8Experts):
            m.fp8_sharded = True


def fp8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The `FP8Linear`, TransformerEngine and `FP8Experts` modules of `model`, by name."""
    from .moe import FP8Experts

    return {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear | FP8Experts) or is_te_linear(m)}


def _te_linear_for(model: nn.Module, recipe, sharded: bool, device: torch.device | None):
    """TransformerEngine's linear class when the recipe asks for it (or `auto` finds it usable) and the model trains
    on a GPU (`device`, else where its parameters are), else `None`."""
    if recipe.backend not in ("te", "auto"):
        return None
    if sharded:
        if recipe.backend == "te":
            raise RuntimeError("FP8 backend 'te' does not run on sharded parameters (ZeRO-3, FSDP2) yet; use 'auto'")
        logger.info("trl-fp8: backend='auto' leaves TransformerEngine out on sharded parameters (ZeRO-3, FSDP2)")
        return None
    ok, why = te_recipe_status(recipe.pow2_scales)
    on_gpu = device.type == "cuda" if device is not None else any(p.is_cuda for p in model.parameters())
    not_on_gpu = "the model is not on a GPU (pass `device=` where it will train)"
    if recipe.backend == "te" and not (ok and on_gpu):
        raise RuntimeError(f"FP8 backend 'te' cannot run here: {why if not ok else not_on_gpu}")
    if te_status()[0] and not (ok and on_gpu):  # TE is there, but not for this scale rule (Blackwell, fp32) or device
        logger.info("trl-fp8: backend='auto' leaves TransformerEngine out (%s)", why if not ok else not_on_gpu)
    if not (ok and on_gpu) or recipe.weight_block_size != [128, 128]:  # TE's block recipe is 128x128 only
        return None
    logger.info("trl-fp8: backend=%r converts linears to TransformerEngine (%s)", recipe.backend, why)
    return te_linear_class()
