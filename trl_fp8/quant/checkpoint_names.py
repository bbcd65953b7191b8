"""The export stream under the names a Hub checkpoint gives its tensors.

transformers renames some checkpoints' tensors as it loads them (its `conversion_mapping.py`): Mixtral's
`block_sparse_moe.experts.{e}.w1.weight` become rows of `mlp.experts.gate_up_proj`, GPT-NeoX's `embed_out` becomes
`lm_head`, MiMo-V2's `attention_sink_bias` becomes `sinks`. `save_pretrained` renames them back
(`revert_weight_conversion`), and vLLM loads checkpoint names, in a refit as from disk: a stream in transformers'
names would stop vLLM's loader (`There is no module or parameter named 'lm_head'`) or leave weights at their dummy
values. So the stream, and the FP8 checkpoint, travel under the checkpoint's names, by transformers' own reversal:

- Once per model, small tagged tensors stand in for the stream's tensors and go through `revert_weight_conversion`;
  which output holds which tag gives each tensor its checkpoint name. A tag is 2x3 with values unique in the stream,
  so any change of layout on the way (a transpose, a permutation, a split, a concatenation) shows as a tag that does
  not come out whole. Fused experts in FP8 travel per expert (`...experts.{e}.gate_proj.weight`, the layout of
  their 128x128 blocks): their fused tensor's tag is cut as the learner cuts it, and each piece must come out whole.
- Every sync, renamed tensors keep their place in the stream, and fused experts kept in high precision travel as
  per-expert views where the checkpoint holds them one by one (Mixtral, Qwen3-MoE), fused where it holds them fused
  (Llama 4). A high-precision tensor whose checkpoint layout is something else again is reverted for real, as
  `save_pretrained` writes it.
- An FP8 weight whose checkpoint holds it in another layout cannot be renamed without being re-quantized: it is
  refused, naming it, before anything is sent or written.
"""

import re
from collections.abc import Iterable

import torch
from torch import nn

from .moe import FP8Experts, expert_views, is_fused_experts


_EXPERT_WEIGHT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_TAG_SHAPE = (4, 3)  # rows enough that an interleave or a permutation of them shows


def _revert(model: nn.Module, state: dict[str, torch.Tensor], prefixes: bool) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import PrefixChange, revert_weight_conversion

    loaded = getattr(model, "_weight_conversions", None)  # what `from_pretrained` applied, if it loaded the model
    if prefixes or loaded is None:  # without it transformers drops prefix changes itself
        return revert_weight_conversion(model, state)
    model._weight_conversions = [c for c in loaded if not isinstance(c, PrefixChange)]
    try:
        return revert_weight_conversion(model, state)
    finally:
        model._weight_conversions = loaded


def _tag(start: int, *shape: int) -> torch.Tensor:
    return torch.arange(start, start + torch.Size(shape).numel(), dtype=torch.float64).view(shape)


def _renames(model: nn.Module, tags: dict, expected: dict, prefixes: bool) -> dict[str, str]:
    """`{name: checkpoint name}` for each name of `expected` whose tag comes out of the reversal of `tags` whole."""
    try:
        reverted = _revert(model, dict(tags), prefixes)
    except Exception:
        # A conversion that cannot run on stand-ins (one that reshapes by the config's head count): tensor by tensor,
        # and those it fails on get no rename (high-precision ones are then reverted for real at each sync).
        reverted = {}
        for name, tag in tags.items():
            try:
                reverted.update(_revert(model, {name: tag}, prefixes))
            except Exception:
                continue
    by_key = {(float(t.flatten()[0]), t.shape): name for name, t in expected.items()}
    renames = {}
    for checkpoint_name, tag in reverted.items():
        name = by_key.get((float(tag.flatten()[0]), tag.shape)) if tag.numel() else None
        if name is not None and torch.equal(tag, expected[name]):
            renames[name] = checkpoint_name
    return renames


def checkpoint_module_names(model: nn.Module, modules: list[str], prefixes: bool = True) -> list[str]:
    """The checkpoint's names of `modules` (vLLM names its modules as the checkpoint does: `ignored_layers` are
    matched against them): a module is renamed as a `weight` under it would be, else keeps its name. `prefixes` as in
    `CheckpointNames`."""
    size = torch.Size(_TAG_SHAPE).numel()
    tags = {f"{m}.weight": _tag(i * size, *_TAG_SHAPE) for i, m in enumerate(modules)}
    renames = _renames(model, tags, tags, prefixes)
    return [renames.get(f"{m}.weight", f"{m}.weight").removesuffix(".weight") for m in modules]


class CheckpointNames:
    """Renames `model`'s export streams to its checkpoint's names (see the module docstring).

    Args:
        model (`nn.Module`):
            The transformers model the stream comes from (no DDP or PEFT wrapper); its conversion mapping is the one
            `from_pretrained` used, or transformers' default for its class.
        stream (`Iterable[tuple[str, torch.Size, torch.dtype]]`):
            Name, shape and dtype of each tensor of the stream, as `iter_fp8_state` yields them (FP8 pairs are
            `...weight` in float8_e4m3fn beside `...weight_scale_inv`).
        prefixes (`bool`, *optional*, defaults to `True`):
            Whether to move tensors back under the prefix `from_pretrained` took off (a Qwen3.5 text model loaded
            from its multimodal checkpoint: `model.language_model.layers`), as `save_pretrained` does. vLLM's text
            model loads them without it (before 0.31 only so).
    """

    def __init__(self, model: nn.Module, stream: Iterable[tuple[str, torch.Size, torch.dtype]], prefixes: bool = True):
        self.model, self.prefixes = model, prefixes
        fused = {n for n, m in model.named_modules() if isinstance(m, FP8Experts) or is_fused_experts(m)}
        tags, expected, start = {}, {}, 0

        def tag(*shape: int) -> torch.Tensor:
            nonlocal start
            start += torch.Size(shape).numel()
            return _tag(start - torch.Size(shape).numel(), *shape)

        rows, cols = _TAG_SHAPE
        fp8, fp8_experts, hp_experts = set(), {}, {}
        for name, shape, dtype in stream:
            if name.endswith("_scale_inv"):
                continue
            if dtype == torch.float8_e4m3fn:
                fp8.add(name)
            match, (prefix, _, leaf) = _EXPERT_WEIGHT.match(name), name.rpartition(".")
            if name in fp8 and match and match["experts"] in fused:
                fp8_experts[match["experts"]] = max(fp8_experts.get(match["experts"], 0), int(match["e"]) + 1)
            elif prefix in fused and leaf in ("gate_up_proj", "down_proj") and len(shape) == 3:
                hp_experts[prefix] = shape[0]
            else:
                tags[name] = expected[name] = tag(rows, cols)
        for prefix, num_experts in (fp8_experts | hp_experts).items():
            # The learner's per-expert cut of transformers' fused tensors (gate rows first, then up): FP8 experts
            # travel so; high-precision ones too, where the checkpoint holds them so.
            gate_up, down = tag(num_experts, 2 * rows, cols), tag(num_experts, rows, cols)
            tags[f"{prefix}.gate_up_proj"], tags[f"{prefix}.down_proj"] = gate_up, down
            if prefix in hp_experts:
                expected[f"{prefix}.gate_up_proj"], expected[f"{prefix}.down_proj"] = gate_up, down
            expected |= {f"{name}.weight": view for name, view in expert_views(f"{prefix}.", gate_up, down)}
        self.renames = _renames(model, tags, expected, prefixes)
        refused = sorted(w for w in fp8 if not self.renames.get(w, "").endswith("weight"))
        if refused:
            match = _EXPERT_WEIGHT.match(refused[0])
            module = match["experts"] if match else refused[0].removesuffix(".weight")
            raise ValueError(
                f"{type(model).__name__}'s checkpoints hold {refused[0]}"
                f"{f' (and {len(refused) - 1} more)' if len(refused) > 1 else ''} in another layout than transformers "
                "computes with (its conversion_mapping.py), so trl-fp8 cannot send or save it in block FP8 under a "
                "checkpoint name without re-quantizing it. Keep it in high precision: fp8_recipe="
                f"FP8Recipe(modules_to_not_convert=[{'.'.join(module.split('.')[-2:])!r}])."
            )
        for weight in fp8:
            self.renames[f"{weight}_scale_inv"] = f"{self.renames[weight]}_scale_inv"
        # High-precision experts the checkpoint holds one by one: sent as views of the fused tensors, not copies.
        self.per_expert = {
            f"{prefix}.{which}"
            for prefix in hp_experts
            if f"{prefix}.0.down_proj.weight" in self.renames
            for which in ("gate_up_proj", "down_proj")
        }

    def __call__(self, pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """`pairs` under checkpoint names, in their order; the tensors not renamed go last, as `save_pretrained`
        writes them."""
        out, rest = [], {}
        for name, t in pairs:
            if name in self.per_expert:
                prefix, _, which = name.rpartition(".")
                gate_up, down = (t, None) if which == "gate_up_proj" else (None, t)
                views = expert_views(f"{prefix}.", gate_up, down)
                out += [(self.renames[f"{piece}.weight"], view) for piece, view in views]
            elif name in self.renames:
                out.append((self.renames[name], t))
            else:
                rest[name] = t
        if rest:
            out.extend(_revert(self.model, rest, self.prefixes).items())
        return out
