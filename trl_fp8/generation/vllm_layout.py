"""How vLLM lays out a block-FP8 decoder, and the checks that must pass before an engine is built.

vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, splits column-parallel layers' outputs and
row-parallel layers' inputs over tensor-parallel ranks, and gives each fused partition one `weight` (N, K) e4m3 and
one `weight_scale_inv` (ceil(N/128), ceil(K/128)) fp32 (`Fp8LinearMethod.create_weights`). Its rule on block shapes
(`fp8_utils.validate_fp8_block_shape`, identical in vLLM 0.22.0 and 0.31.0):

- row-parallel with TP > 1: the per-rank input must be a multiple of block_k;
- column-parallel with TP > 1: every shard's per-rank output must be a multiple of block_n;
- fused layers without TP: every shard but the last must be a multiple of block_n.

And vLLM's `is_layer_skipped` needs every shard of a fused layer in the same precision. These are checked here, on
the learner, so that a bad combination fails at `FP8GRPOTrainer(...)` naming the layer, not deep inside vLLM.
"""

import math
from dataclasses import dataclass

from torch import nn

from ..quant.convert import layer_of, named_linears, select_fp8_experts, select_fp8_linears
from ..quant.export import PRE_FUSED, high_precision_modules
from ..quant.linear import full_shape


# vLLM's stacked-parameter mappings: Llama-style decoders (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE attention),
# DeepSeek-V3's MLA, whose `fused_qkv_a_proj` is replicated on every rank (no TP split), and Qwen3.5's Gated DeltaNet
# (`qwen3_5.py`'s packed modules; `in_proj_qkvz` is cut into q, k, v and z, `qwen_gdn_linear_attn.py`).
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
REPLICATED = ("fused_qkv_a_proj",)
# Column-parallel layers vLLM builds with a single output partition (`qwen_gdn_linear_attn.py`, `create_qkvz_proj`).
ONE_SHARD = ("in_proj_qkvz",)
# Row-parallel in vLLM: Llama-style o/down, Gated DeltaNet's and OPT's out_proj, GPT-NeoX's and Phi's dense,
# GPT-NeoX's dense_4h_to_h, Phi's and OPT's fc2 (`gpt_neox.py`, `phi.py`, `opt.py`).
ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "dense", "dense_4h_to_h", "fc2")


@dataclass
class VLLMLinear:
    """One linear as vLLM builds it on one tensor-parallel rank."""

    name: str  # vLLM's module name, e.g. `model.layers.0.self_attn.qkv_proj`
    shards: tuple[str, ...]  # the Hugging Face modules it holds, in order
    input_size: int  # K of the whole layer
    input_size_per_partition: int
    output_partition_sizes: tuple[int, ...]  # each shard's rows on this rank
    tp_size: int
    parts: tuple[str, ...] = ()  # what each of output_partition_sizes is, for messages (default: the shards)
    # Names vLLM's `is_layer_skipped` looks up for this layer that the learner has no module for (Gemma 4's
    # `attention_k_eq_v` layers: `v_proj`): in `ignored_layers` whenever the shards are, or vLLM refuses the layer.
    aliases: tuple[str, ...] = ()

    @property
    def weight_shape(self) -> tuple[int, int]:
        return sum(self.output_partition_sizes), self.input_size_per_partition

    @property
    def scale_shape(self) -> tuple[int, int]:
        n, k = self.weight_shape
        return math.ceil(n / 128), math.ceil(k / 128)

    def block_shape_error(self, block: tuple[int, int] = (128, 128)) -> str | None:
        """vLLM's `validate_fp8_block_shape`, as a message (or `None` when the layer passes)."""
        block_n, block_k = block
        row_split = self.tp_size > 1 and self.input_size // self.input_size_per_partition == self.tp_size
        if row_split and self.input_size_per_partition % block_k:
            return f"input per rank {self.input_size_per_partition} is not a multiple of {block_k}"
        tp_split = self.tp_size > 1 and self.name.rsplit(".", 1)[-1] not in ROW_PARALLEL
        sizes = self.output_partition_sizes
        if tp_split or len(sizes) > 1:
            checked = sizes if tp_split else sizes[:-1]
            bad = [(part, n) for part, n in zip(self.parts or self.shards, checked, strict=False) if n % block_n]
            if bad:
                part, n = bad[0]
                return f"output of {part} per rank is {n}, not a multiple of {block_n}"
        return None


def _attention_rows(config, tp_size: int) -> dict[str, int]:
    """Rows of q, k and v on one rank: KV heads are replicated when there are fewer of them than ranks."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_per_rank = max(1, kv_heads // tp_size)
    return {"q_proj": heads // tp_size * head_dim, "k_proj": kv_per_rank * head_dim, "v_proj": kv_per_rank * head_dim}


def _layer_config(config, name: str):
    """The config of the decoder layer that module `name` belongs to: a heterogeneous config (Gemma 4's: head_dim 256
    in sliding-window layers, 512 in full-attention ones) refuses per-layer attributes such as `head_dim` globally."""
    per_layer, index = getattr(config, "per_layer_config", None), layer_of(name, None)
    return per_layer[index] if per_layer is not None and index is not None else config


def _kv_shared(config, name: str) -> bool:
    """Whether `name` is in one of the last `num_kv_shared_layers` layers (Gemma 3n, Gemma 4), which read another
    layer's K/V: transformers gives them q_proj alone, and vLLM 0.31 builds a plain column-parallel `q_proj` there
    (gemma3n.py and gemma4.py, `Gemma3nAttention` / `Gemma4Attention`)."""
    i, shared = layer_of(name, None), getattr(config, "num_kv_shared_layers", 0) or 0
    return i is not None and shared > 0 and i >= config.num_hidden_layers - shared


def _values_are_keys(config, name: str) -> bool:
    """Whether `name` is in a Gemma 4 `attention_k_eq_v` layer (a full-attention layer that stores K/V): transformers
    gives it k_proj and no v_proj, and vLLM 0.31 still builds its `qkv_proj`, loading k_proj into both the K and the V
    shard (gemma4.py, `_gemma4_layer_weights_mapper`)."""
    i = layer_of(name, None)
    if not getattr(config, "attention_k_eq_v", False) or i is None or _kv_shared(config, name):
        return False
    return list(config.layer_types)[i] == "full_attention"


def vllm_linears(model: nn.Module, tp_size: int = 1) -> list[VLLMLinear]:
    """The linears vLLM builds for `model`'s decoder layers on one rank (fused where vLLM fuses)."""
    modules = named_linears(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    out = []
    for name, module in modules.items():
        parent, _, leaf = name.rpartition(".")
        fused = next((f for f, shards in FUSED.items() if leaf == shards[0]), None)
        if fused is not None:
            shards = tuple(f"{parent}.{s}" for s in FUSED[fused])
            present = tuple(s for s in shards if s in modules)
            if fused == "qkv_proj" and present == shards[:1] and _kv_shared(config, name):
                # vLLM builds the KV-shared layer's q_proj alone: one column-parallel partition.
                k = module.in_features
                out.append(VLLMLinear(name, (name,), k, k, (module.out_features // tp_size,), tp_size))
                continue
            if fused == "qkv_proj" and present == shards[:2] and _values_are_keys(config, name):
                # vLLM's qkv_proj of q_proj and k_proj, k_proj loaded again into the V shard: three partitions.
                attention = _attention_rows(_layer_config(config, name), tp_size)
                rows = (attention["q_proj"], attention["k_proj"], attention["v_proj"])
                parts = (shards[0], shards[1], f"{shards[1]} (loaded again as {shards[2]})")
                k = module.in_features
                out.append(VLLMLinear(f"{parent}.{fused}", shards[:2], k, k, rows, tp_size, parts, (shards[2],)))
                continue
            if present != shards:
                continue
            attention = _attention_rows(_layer_config(config, name), tp_size)
            tp = 1 if fused in REPLICATED else tp_size
            rows = tuple(attention.get(s.rpartition(".")[2], modules[s].out_features // tp) for s in shards)
            if fused == "qkv_proj" and module.out_features == 2 * attention["q_proj"] * tp_size:
                # A gated q_proj (Qwen3.5, Qwen3-Next: the attention output gate folded into it): twice the rows.
                rows = (2 * rows[0], *rows[1:])
            parts = ()
            if fused == "in_proj_qkvz":  # in_proj_qkv holds q, k and v: four partitions, each in whole blocks
                qk, value = rows[0] - rows[1], rows[1]  # in_proj_qkv: (2 key + value) / tp rows; in_proj_z: value / tp
                rows, parts = (qk // 2, qk // 2, value, value), ("q", "k", "v", "z")
                parts = tuple(f"the {p} part of {parent}.{fused}" for p in parts)
            k = module.in_features
            out.append(VLLMLinear(f"{parent}.{fused}", shards, k, k, rows, tp, parts))
        elif leaf in ONE_SHARD:
            # Fused on disk in an order vLLM keeps (Qwen3-Next interleaves q, k, v and z by key-head group): one
            # output partition, split over the ranks as a whole.
            k = module.in_features
            out.append(VLLMLinear(name, (name,), k, k, (module.out_features // tp_size,), tp_size))
        elif leaf in ROW_PARALLEL:
            k = module.in_features
            out.append(VLLMLinear(name, (name,), k, k // tp_size, (module.out_features,), tp_size))
        elif leaf in PRE_FUSED:
            # One module, which vLLM cuts into the same q/k/v or gate/up shards while loading
            # (`_load_fused_module_from_checkpoint`, block scales at offset / 128): the same block rules hold per part.
            parts = PRE_FUSED[leaf]
            if leaf == "qkv_proj":
                attention = _attention_rows(_layer_config(config, name), tp_size)
                rows = tuple(attention[f"{p}_proj"] for p in parts)
            else:
                rows = (module.out_features // 2 // tp_size,) * 2
            k = module.in_features
            labels = tuple(f"the {p} part of {name}" for p in parts)
            out.append(VLLMLinear(name, (name,), k, k, rows, tp_size, labels))
    return out


def check_vllm_fp8_layers(model: nn.Module, recipe, tp_size: int = 1) -> list[str]:
    """Raises a `ValueError` naming the first layer vLLM would refuse in block FP8 with `tp_size` ranks (a block
    shape, or fused shards in different precisions); returns the Hugging Face names of what stays in high precision,
    for vLLM's `ignored_layers`: linears, MoE routers (whatever their class: vLLM would otherwise build some of them
    in FP8) and fused experts the recipe keeps out of FP8."""
    fp8 = set(select_fp8_linears(model, recipe)[0])
    fp8_experts = select_fp8_experts(model, recipe)[0]
    kept = [n for n in high_precision_modules(model, fp8 | set(fp8_experts)) if "lm_head" not in n.split(".")]
    for name in fp8_experts:
        # vLLM's `validate_fp8_block_shape_moe`: each rank's slice of the expert intermediate size in whole blocks.
        intermediate = full_shape(model.get_submodule(name).gate_up_proj)[1] // 2  # (a ZeRO-3 shard is empty)
        if (intermediate // tp_size) % 128:
            raise ValueError(
                f"vLLM cannot serve {name} in block FP8 with vllm_tensor_parallel_size={tp_size}: the expert "
                f"intermediate size per rank is {intermediate // tp_size}, not a multiple of 128. Use another "
                "tensor-parallel size, or keep the experts in high precision with FP8Recipe.modules_to_not_convert."
            )
    check_interleaved_qkv(model, fp8, tuple(recipe.weight_block_size))
    for layer in vllm_linears(model, tp_size):
        in_fp8 = [s in fp8 for s in layer.shards]
        if any(in_fp8) and not all(in_fp8):
            split = ", ".join(
                f"{s} ({'FP8' if f else 'high precision'})" for s, f in zip(layer.shards, in_fp8, strict=True)
            )
            raise ValueError(
                f"vLLM fuses {layer.name} and needs all its shards in one precision, but the recipe gives {split}. "
                "Keep the whole group in high precision with FP8Recipe.modules_to_not_convert."
            )
        if not any(in_fp8):
            kept.extend(a for a in layer.aliases if a not in kept)
        if all(in_fp8):
            error = layer.block_shape_error(tuple(recipe.weight_block_size))
            if error:
                raise ValueError(
                    f"vLLM cannot serve {layer.name} in block FP8 with vllm_tensor_parallel_size={tp_size}: {error} "
                    f"(weight {layer.weight_shape[0]}x{layer.weight_shape[1]} per rank). Use another tensor-parallel "
                    "size, or keep the layer in high precision with FP8Recipe.modules_to_not_convert."
                )
    return kept


def check_interleaved_qkv(model: nn.Module, fp8: set[str], block: tuple[int, int]) -> None:
    """GPT-NeoX stores `query_key_value` rows as (heads, 3, head_dim), and vLLM's `gpt_neox.py` re-orders every tensor
    of that name to (3, heads, head_dim) as it loads (`_repack_qkv`, `weight_scale_inv` included). Moving whole
    128-row blocks, this keeps the learner's grid when head_dim is a multiple of the block; otherwise blocks straddle
    heads, the scales cannot follow, and vLLM's reshape fails at the first refit: refused here, naming the layer."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "model_type", None) != "gpt_neox":
        return
    head_dim = config.hidden_size // config.num_attention_heads
    interleaved = sorted(n for n in fp8 if n.rpartition(".")[2] == "query_key_value")
    if interleaved and head_dim % block[0]:
        raise ValueError(
            f"vLLM cannot serve {interleaved[0]} in block FP8: it re-orders GPT-NeoX's query_key_value rows from "
            f"(heads, 3, head_dim) to (3, heads, head_dim) while loading, and head_dim {head_dim} is not a multiple "
            f"of the {block[0]}-row weight block, so the block scales cannot follow. Keep it in high precision: "
            "FP8Recipe(modules_to_not_convert=['attention.query_key_value'])."
        )


def with_nested_renames(ignored: list[str], prefix_maps: list[dict[str, str | None]]) -> list[str]:
    """`ignored` (vLLM's `ignored_layers`, named from the root) and, for each name, its renames by the prefix maps of
    vLLM's nested quantized models. Such a model (`SupportsQuant`) renames `ignored_layers` with its own
    `hf_to_vllm_mapper`, whose prefixes are relative to it, not to the root (Gemma 3n's text model moves its AltUp
    and per-layer-input projections under `self_decoder`): no root name matches them, and vLLM would build those
    layers in FP8 while the learner keeps them in high precision. Added names that name no vLLM module change
    nothing."""
    out = dict.fromkeys(ignored)
    for name in ignored:
        parts = name.split(".")
        for i in range(1, len(parts)):
            outer, inner = ".".join(parts[:i]), ".".join(parts[i:]) + "."
            for mapping in prefix_maps:
                for old, new in mapping.items():
                    if new is not None and inner.startswith(old):
                        out[f"{outer}.{new}{inner[len(old) :]}".removesuffix(".")] = None
    return list(out)


def vllm_nested_prefix_maps(architectures: list[str]) -> list[dict[str, str | None]]:
    """The `orig_to_new_prefix` maps of the nested quantized models (`SupportsQuant` classes other than the root) in
    the vLLM modules serving `architectures`, read from vLLM itself (none for an architecture it does not list, or
    without vLLM: `fp8_llm_kwargs` is also checked where vLLM is not installed)."""
    import importlib
    import inspect

    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import SupportsQuant
    except ImportError:
        return []

    maps = []
    for arch in architectures:
        entry = ModelRegistry.models.get(arch)
        if getattr(entry, "module_name", None) is None:
            continue
        for name, cls in inspect.getmembers(importlib.import_module(entry.module_name), inspect.isclass):
            mapper = getattr(cls, "hf_to_vllm_mapper", None)
            if name != arch and issubclass(cls, SupportsQuant) and getattr(mapper, "orig_to_new_prefix", None):
                maps.append(dict(mapper.orig_to_new_prefix))
    return maps
