"""The FP8 state stream: one format for refitting samplers and for writing checkpoints.

`iter_fp8_state(model)` yields `(name, tensor)` in Hugging Face parameter names, in the DeepSeek-V3 / vLLM
block-FP8 checkpoint format:

    model.layers.0.self_attn.q_proj.weight            float8_e4m3fn (N, K)   the learner's own quantized weight
    model.layers.0.self_attn.q_proj.weight_scale_inv  float32 (ceil(N/128), ceil(K/128))
    model.layers.0.self_attn.q_proj.bias              model dtype
    model.embed_tokens.weight, ...norm.weight, lm_head.weight   unconverted tensors in their own dtype

For an `FP8Linear` the pair is its cached quantization, so a sampler loading the stream holds the learner's weight
grid bit for bit. A high-precision learner with an FP8 sampler ("FP8 generation only") passes `recipe`: the linears
the recipe selects are then quantized here, with the recipe's rule.
"""

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .adapters import effective_weight, fp8_weight, lora_layers
from .blockwise import FP8_DTYPE, quantize_blockwise
from .checkpoint_names import CheckpointNames
from .convert import is_router, named_linears, select_fp8_experts, select_fp8_linears
from .kv_cache import KV_SCALE_SUFFIXES
from .linear import FP8Linear
from .moe import FP8Experts, is_fused_experts, iter_expert_pairs
from .te_linear import is_te_linear


Gather = Callable[[list[nn.Parameter]], contextlib.AbstractContextManager]


def iter_fp8_state(model: nn.Module, recipe=None, gather: Gather | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the stream of `model` (unwrapped: no DDP `module.` prefix). Tied parameters appear once. `recipe`
    (an `FP8Recipe`, a dict of its fields or a recipe path, as `convert_to_fp8` takes) also quantizes the linears it
    selects that are still high precision; without it only converted modules are sent in FP8.

    `gather` materializes sharded parameters, given a list of them (DeepSpeed ZeRO-3's `GatheredParameters`, or
    FSDP2's unit `unshard()`, which swaps whole tensors into the modules): each module's parameters are gathered
    while it is read, one module at a time, and what is yielded is copied out of the gathered storage, which
    returns to its shards right after."""
    to_quantize: set[str] = set()
    experts_to_quantize: set[str] = set()
    if recipe is not None:
        from ..recipe import FP8Recipe  # the recipe module imports trl_fp8.quant

        recipe = FP8Recipe.from_any(recipe)
        to_quantize = set(select_fp8_linears(model, recipe)[0])
        experts_to_quantize = set(select_fp8_experts(model, recipe)[0])
    _check_gatherable(model, gather)
    done: set[str] = set()
    adapted = lora_layers(model)
    inside_adapted = tuple(f"{name}." for name in adapted)  # base layers and adapters: one merged weight each
    # Every other parameter goes as it is, with its module, in module order: a layer's norms arrive with its linears
    # (vLLM's layerwise reload completes a layer once all of its tensors have arrived, and FSDP2 gathers each
    # layer once). Tied parameters under their first name only, as `named_parameters()` gives them.
    as_they_are = {n for n, _ in model.named_parameters() if not n.startswith(inside_adapted)}
    for mod_name, module in model.named_modules():
        if mod_name.startswith(inside_adapted):
            continue
        fused_experts = isinstance(module, FP8Experts) or mod_name in experts_to_quantize
        if (
            mod_name in adapted
            or fused_experts
            or isinstance(module, FP8Linear)
            or is_te_linear(module)
            or mod_name in to_quantize
        ):
            with _gathering(gather, _read_together(module)):
                pairs = _copied(_module_pairs(mod_name, module, adapted, to_quantize, fused_experts, recipe), gather)
            yield from pairs
            done.update(n for n, _ in pairs)
            if fused_experts:
                done.update(f"{mod_name}.{which}" for which in ("gate_up_proj", "down_proj"))
        prefix = f"{mod_name}." if mod_name else ""
        own = [f"{prefix}{n}" for n, _ in module.named_parameters(recurse=False)]
        own = [n for n in own if n in as_they_are and n not in done]
        yield from _as_they_are(model, own, gather)
        done.update(own)
    yield from persistent_buffers(model)


def _as_they_are(model: nn.Module, names: list[str], gather: Gather | None) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters `names` as they are, each module's gathered at once (one collective per module, not per
    tensor), and read from the module inside the gather (FSDP2 swaps whole tensors in for the parameters)."""
    for prefix, group in itertools.groupby(names, key=lambda name: name.rpartition(".")[0]):
        module = model.get_submodule(prefix)
        leaves = [name.rpartition(".")[2] for name in group]
        with _gathering(gather, [getattr(module, leaf) for leaf in leaves]):
            pairs = [(f"{prefix}.{leaf}" if prefix else leaf, getattr(module, leaf).detach()) for leaf in leaves]
            pairs = _copied(pairs, gather)
        yield from pairs


def _module_pairs(
    mod_name: str, module: nn.Module, adapted: dict, to_quantize: set, fused_experts: bool, recipe
) -> list[tuple[str, torch.Tensor]]:
    """What one module that runs (or is sent) in FP8 sends: its FP8 pairs, then its bias."""
    prefix = f"{mod_name}." if mod_name else ""
    if mod_name in adapted:
        return list(_adapted_pairs(prefix, module, mod_name in to_quantize, recipe))
    if fused_experts:
        return _expert_pairs(prefix, module, recipe)
    if isinstance(module, FP8Linear) or is_te_linear(module):
        q, s = module.quantized_weight()
    else:
        q, s = quantize_blockwise(
            module.weight.detach(),
            tuple(recipe.weight_block_size),
            pow2_scales=recipe.pow2_scales,
            name=f"{prefix}weight",
        )
    pairs = [(f"{prefix}weight", q), (f"{prefix}weight_scale_inv", s)]
    if module.bias is not None:
        # Right after its weight: vLLM's layerwise reload processes a layer once all its tensors have arrived.
        pairs.append((f"{prefix}bias", module.bias.detach()))
    return pairs


def _expert_pairs(prefix: str, module: nn.Module, recipe) -> list[tuple[str, torch.Tensor]]:
    """Fused MoE experts as the checkpoint's per-expert FP8 linears."""
    fused = {}
    for which in ("gate_up_proj", "down_proj"):
        if isinstance(module, FP8Experts):
            fused[which] = module.quantized(which)
        else:
            w = getattr(module, which).detach()
            fused[which] = quantize_blockwise(w, (128, 128), pow2_scales=recipe.pow2_scales, name=prefix + which)
    return list(iter_expert_pairs(prefix, fused["gate_up_proj"], fused["down_proj"]))


def _adapted_pairs(prefix: str, layer, quantize: bool, recipe) -> Iterator[tuple[str, torch.Tensor]]:
    """A PEFT LoRA layer as the checkpoint's plain linear (`prefix` + `weight`, ...): the weight it computes with,
    merged, in FP8 when it runs in FP8 (or `quantize`s by the recipe), else in high precision."""
    pair = fp8_weight(layer, prefix.rstrip("."))
    if pair is None and quantize:
        pair = quantize_blockwise(
            effective_weight(layer),
            tuple(recipe.weight_block_size),
            pow2_scales=recipe.pow2_scales,
            name=f"{prefix}weight",
        )
    if pair is None:
        yield f"{prefix}weight", effective_weight(layer)
    else:
        yield f"{prefix}weight", pair[0]
        yield f"{prefix}weight_scale_inv", pair[1]
    if layer.get_base_layer().bias is not None:
        yield f"{prefix}bias", layer.get_base_layer().bias.detach()


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint buffers (e.g. a router's `e_score_correction_bias`), not the recomputed ones (RoPE), named as
    `state_dict` names them. Read from each module's own table rather than from a state dict, which would gather a
    sharded learner."""
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            yield name, buf.detach()


def stream_nbytes(pairs: list[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    """`(bytes of the stream, bytes the same weights take in BF16 without scales)`."""
    sent = sum(t.numel() * t.element_size() for _, t in pairs)
    bf16 = sum(t.numel() * 2 for name, t in pairs if not name.endswith("_scale_inv"))
    return sent, bf16


def iter_hp_state(model: nn.Module, gather: Gather | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The high-precision stream: every parameter and checkpoint buffer as the learner holds it (a LoRA layer's
    weight merged, under the plain linear's names). `gather` as in `iter_fp8_state`."""
    _check_gatherable(model, gather)
    adapted = lora_layers(model)
    inside_adapted = tuple(f"{name}." for name in adapted)
    for name, layer in adapted.items():
        with _gathering(gather, layer.parameters()):
            pairs = [(f"{name}.weight", effective_weight(layer))]
            if layer.get_base_layer().bias is not None:
                pairs.append((f"{name}.bias", layer.get_base_layer().bias.detach()))
            pairs = _copied(pairs, gather)
        yield from pairs
    yield from _as_they_are(
        model, [n for n, _ in model.named_parameters() if not n.startswith(inside_adapted)], gather
    )
    yield from persistent_buffers(model)


def _read_together(module: nn.Module) -> list[nn.Parameter]:
    """The parameters reading `module`'s FP8 weight reads: its own, or, for a sibling linear, its group's (quantized
    stacked)."""
    group = module._group() if isinstance(module, FP8Linear) else None
    members = [module] if group is None else group.members
    return [p for m in members for p in m.parameters()]


def _gathering(gather: Gather | None, params: Iterable[nn.Parameter]) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if gather is None else gather(list(params))


def _check_gatherable(model: nn.Module, gather: Gather | None) -> None:
    """Refuses, before anything is read, to stream FSDP2's shards (`DTensor` parameters) without a `gather`."""
    if gather is None:
        sharded = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
        if sharded is not None:
            raise ValueError(
                f"{sharded} is an FSDP2 shard (a DTensor): pass gather= (trl_fp8.generation.gather.FSDP2Gather) "
                "to read the whole weights"
            )


def _copied(pairs: list[tuple[str, torch.Tensor]], gather: Gather | None) -> list[tuple[str, torch.Tensor]]:
    # Gathered storage returns to its shards when the gather ends: what leaves it must be a copy.
    if gather is None:
        return pairs
    for name, t in pairs:
        if isinstance(t, DTensor):  # a shard the gather did not make whole: never sent as if it were the weight
            raise ValueError(f"{name} is still an FSDP2 shard (a DTensor) inside the gather; nothing was sent")
    return [(n, t.clone()) for n, t in pairs]


@torch.no_grad()
def load_state_stream(model: nn.Module, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies a state stream into `model`'s parameters and buffers of the same names, all or nothing.

    Every pair is checked first (known name, same shape, same dtype) and every tensor of `model` must be covered
    (tied tensors once): a missing `weight_scale_inv` is an error, never a silent 1.0. Only then is anything copied,
    so a bad stream leaves `model` on its last good weights.
    """
    pairs = list(pairs)  # `iter_fp8_state` is a generator: checked first, copied after
    targets = model.state_dict(keep_vars=True)
    problems = []
    seen = set()
    for name, tensor in pairs:
        if name in seen:
            problems.append(f"{name}: twice in the stream")
        seen.add(name)
        target = targets.get(name)
        if target is None:
            problems.append(f"{name}: not a tensor of the sampler")
        elif tuple(tensor.shape) != tuple(target.shape) or tensor.dtype != target.dtype:
            problems.append(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, "
                f"the sampler holds {tuple(target.shape)} {target.dtype}"
            )
    tied: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in pairs:
        if name in targets:
            tied.setdefault(id(targets[name]), []).append((name, tensor))
    for same in tied.values():  # one tensor in the sampler (its config ties them), two in the learner: one is lost
        if any(not torch.equal(same[0][1], t) for _, t in same[1:]):
            problems.append(
                f"{' and '.join(n for n, _ in same)}: one tensor in the sampler (tied, as the model's config says), "
                "but different in the stream (the learner's are not tied)"
            )
    covered = {targets[name].data_ptr() for name, _ in pairs if name in targets}
    missing = sorted({n for n, t in targets.items() if t.data_ptr() not in covered})
    if missing:
        problems.append(f"missing from the stream: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if problems:
        raise ValueError("refusing to load the FP8 state stream; nothing was changed:\n  " + "\n  ".join(problems))
    for name, tensor in pairs:
        targets[name].copy_(tensor)


# Fused already on the Hugging Face side (Phi-3, Phi-4-mini): vLLM looks these up by their parts' names (q_proj,
# k_proj, v_proj; gate_proj, up_proj), in `is_layer_skipped` as in its TP layout.
PRE_FUSED = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}


def high_precision_modules(model: nn.Module, fp8: set[str]) -> list[str]:
    """What a block-FP8 loader must build in high precision, given the names of the linears and fused experts in
    FP8, named as vLLM and transformers look them up: the other linears (nn.Linear subclasses too, Falcon's
    FalconLinear; a module fused on disk also by its parts' names), MoE routers whatever their class (vLLM would
    otherwise build some of them in FP8), and the other fused experts."""
    kept = []
    linears = named_linears(model)
    inside_adapted = tuple(f"{name}." for name in lora_layers(model))
    for name, m in model.named_modules():
        if name.startswith(inside_adapted):
            continue
        if name in linears and name not in fp8:
            kept.append(name)
            parent, _, leaf = name.rpartition(".")
            if leaf in PRE_FUSED:
                kept.extend(f"{parent}.{part}_proj" for part in PRE_FUSED[leaf])
        elif is_router(name) and isinstance(getattr(m, "weight", None), torch.Tensor):
            kept.append(name)
        elif is_fused_experts(m) and name not in fp8:
            kept.append(name)
    return kept


def stream_checkpoint_names(
    model: nn.Module, recipe, attention_names: Sequence[str] = (), prefixes: bool = True, gather: Gather | None = None
) -> CheckpointNames:
    """The checkpoint names `model`'s stream (with Q/K/V scales for `attention_names`) travels and is saved under,
    found before anything is sent or written: what cannot have one is refused here. `prefixes` as in
    `CheckpointNames`; `gather` as in `iter_fp8_state`."""
    converted = getattr(model, "fp8_recipe", None) is not None
    stream = [(n, t.shape, t.dtype) for n, t in iter_fp8_state(model, None if converted else recipe, gather)]
    scalar = (torch.Size(), torch.float32)
    stream += [(f"{attention}.{x}_scale", *scalar) for attention in attention_names for x in "kvq"]
    return CheckpointNames(model, stream, prefixes)


def refuse_nonfinite(
    pairs: list[tuple[str, torch.Tensor]], outcome: str = "nothing was loaded, the sampler keeps its last weights"
) -> None:
    """Raises a `ValueError` naming the tensors of a stream that hold NaN or inf, or a dequant multiplier (weight or
    Q/K/V scale) that is not positive, before any of it reaches an engine or a file; `outcome` says what was spared.

    FP8 weights are checked where they are quantized (`quantized_weight()`); this covers the rest (embeddings, norms,
    `lm_head`, biases, layers kept in high precision) and the scales. One host sync for the whole stream.
    """
    checks = []
    for name, t in pairs:
        if name.endswith(("_scale_inv", *KV_SCALE_SUFFIXES)):  # vLLM would take a non-positive KV scale for 1.0
            checks.append((name, torch.isfinite(t).all() & (t > 0).all()))
        elif t.is_floating_point() and t.dtype != FP8_DTYPE:
            checks.append((name, torch.isfinite(t).all()))
    if not checks:
        return
    ok = torch.stack([c.to(checks[0][1].device) for _, c in checks]).cpu()
    if not bool(ok.all()):
        bad = [name for (name, _), good in zip(checks, ok.tolist(), strict=True) if not good]
        raise ValueError(
            f"the FP8 state stream holds NaN, inf or non-positive scales in {bad[:5]}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            + f"; {outcome}"
        )
