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
- Every sync, renamed tensors keep their place in the stream; a high-precision tensor whose checkpoint layout differs
  (fused experts kept in high precision, which checkpoints store one by one) is reverted for real, as
  `save_pretrained` writes it (views, no copies, for the expert splits).
- An FP8 weight whose checkpoint holds it in another layout cannot be renamed without being re-quantized: it is
  refused, naming it, before anything is sent or written.
"""

import re

import torch
from torch import nn

from .moe import FP8Experts, is_fused_experts


_EXPERT_WEIGHT = re.compile(r"^(?P<experts>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")
_TAG_SHAPE = (2, 3)


def _revert(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state)


def _tag(start: int, *shape: int) -> torch.Tensor:
    return torch.arange(start, start + torch.Size(shape).numel(), dtype=torch.float64).view(shape)


def _renames(model: nn.Module, tags: dict, expected: dict) -> dict[str, str]:
    """`{name: checkpoint name}` for each name of `expected` whose tag comes out of the reversal of `tags` whole."""
    by_first = {float(t.flatten()[0]): name for name, t in expected.items()}
    renames = {}
    for checkpoint_name, tag in _revert(model, dict(tags)).items():
        name = by_first.get(float(tag.flatten()[0])) if tag.numel() else None
        if name is not None and tag.shape == expected[name].shape and torch.equal(tag, expected[name]):
            renames[name] = checkpoint_name
    return renames


def checkpoint_module_names(model: nn.Module, modules: list[str]) -> list[str]:
    """The checkpoint's names of `modules` (vLLM names its modules as the checkpoint does: `ignored_layers` are
    matched against them): a module is renamed as a `weight` under it would be, else keeps its name."""
    tags = {f"{m}.weight": _tag(i * 6, *_TAG_SHAPE) for i, m in enumerate(modules)}
    renames = _renames(model, tags, tags)
    return [renames.get(f"{m}.weight", f"{m}.weight").removesuffix(".weight") for m in modules]


class CheckpointNames:
    """Renames `model`'s export streams to its checkpoint's names (see the module docstring).

    Args:
        model (`nn.Module`):
            The transformers model the stream comes from (no DDP or PEFT wrapper); its conversion mapping is the one
            `from_pretrained` used, or transformers' default for its class.
        names (`list[str]`):
            The stream's tensor names, as `iter_fp8_state` yields them (FP8 pairs are `...weight` in
            float8_e4m3fn beside `...weight_scale_inv`).
        fp8_weights (`set[str]`):
            Which of `names` are FP8 weights.
    """

    def __init__(self, model: nn.Module, names: list[str], fp8_weights: set[str]):
        self.model = model
        fused = {n for n, m in model.named_modules() if isinstance(m, FP8Experts) or is_fused_experts(m)}
        tags, expected = self._tags([n for n in names if not n.endswith("_scale_inv")], fp8_weights, fused)
        self.renames = _renames(model, tags, expected)
        refused = sorted(w for w in fp8_weights if not self.renames.get(w, "").endswith("weight"))
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
        for weight in fp8_weights:
            self.renames[f"{weight}_scale_inv"] = f"{self.renames[weight]}_scale_inv"

    @staticmethod
    def _tags(names: list[str], fp8_weights: set[str], fused: set[str]) -> tuple[dict, dict]:
        """The stand-ins fed to the reversal (`{runtime state name: tag}`) and each stream tensor's own tag; `fused`
        names the fused experts modules (the others' per-expert names are their own linears')."""
        tags, expected, start = {}, {}, 0

        def tag(*shape: int) -> torch.Tensor:
            nonlocal start
            start += torch.Size(shape).numel()
            return _tag(start - torch.Size(shape).numel(), *shape)

        rows, cols = _TAG_SHAPE
        experts: dict[str, int] = {}
        for name in names:
            match = _EXPERT_WEIGHT.match(name)
            if name in fp8_weights and match and match["experts"] in fused:
                experts[match["experts"]] = max(experts.get(match["experts"], 0), int(match["e"]) + 1)
            else:
                tags[name] = expected[name] = tag(rows, cols)
        for prefix, num_experts in experts.items():
            # The learner's per-expert cut of transformers' fused tensors: gate rows first, then up.
            gate_up, down = tag(num_experts, 2 * rows, cols), tag(num_experts, rows, cols)
            tags[f"{prefix}.gate_up_proj"], tags[f"{prefix}.down_proj"] = gate_up, down
            for e in range(num_experts):
                expected[f"{prefix}.{e}.gate_proj.weight"] = gate_up[e, :rows]
                expected[f"{prefix}.{e}.up_proj.weight"] = gate_up[e, rows:]
                expected[f"{prefix}.{e}.down_proj.weight"] = down[e]
        return tags, expected

    def __call__(self, pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """`pairs` under checkpoint names, in their order; the tensors not renamed go last, as `save_pretrained`
        writes them."""
        out, rest = [], {}
        for name, t in pairs:
            if name in self.renames:
                out.append((self.renames[name], t))
            else:
                rest[name] = t
        if rest:
            out.extend(_revert(self.model, rest).items())
        return out
