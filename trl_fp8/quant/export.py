"""The FP8 state stream (DESIGN §3): one format for refitting samplers and for writing checkpoints.

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

import copy
import os
from collections.abc import Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from .blockwise import quantize_blockwise
from .convert import select_fp8_experts, select_fp8_linears
from .linear import FP8Linear
from .moe import FP8Experts, iter_expert_pairs
from .te_linear import is_te_linear


def iter_fp8_state(model: nn.Module, recipe=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the stream of `model` (unwrapped: no DDP `module.` prefix). Tied parameters appear once."""
    to_quantize: set[str] = set()
    experts_to_quantize: set[str] = set()
    if recipe is not None:
        to_quantize = set(select_fp8_linears(model, recipe)[0])
        experts_to_quantize = set(select_fp8_experts(model, recipe)[0])
    done: set[str] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, FP8Experts) or mod_name in experts_to_quantize:
            fused = {}
            for which in ("gate_up_proj", "down_proj"):
                if isinstance(module, FP8Experts):
                    fused[which] = module.quantized(which)
                else:
                    w = getattr(module, which).detach()
                    fused[which] = quantize_blockwise(
                        w, (128, 128), pow2_scales=recipe.pow2_scales, name=prefix + which
                    )
                done.add(prefix + which)
            yield from iter_expert_pairs(prefix, fused["gate_up_proj"], fused["down_proj"])
            continue
        if isinstance(module, FP8Linear) or is_te_linear(module):
            q, s = module.quantized_weight()
        elif mod_name in to_quantize:
            q, s = quantize_blockwise(
                module.weight.detach(),
                tuple(recipe.weight_block_size),
                pow2_scales=recipe.pow2_scales,
                name=f"{prefix}weight",
            )
        else:
            continue
        yield f"{prefix}weight", q
        yield f"{prefix}weight_scale_inv", s
        done.add(f"{prefix}weight")
        if module.bias is not None:
            # Right after its weight: vLLM's layerwise reload processes a layer once all its tensors have arrived.
            yield f"{prefix}bias", module.bias.detach()
            done.add(f"{prefix}bias")
    for name, param in model.named_parameters():
        if name not in done:
            yield name, param.detach()
    yield from _persistent_buffers(model)


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # Checkpoint buffers (e.g. DeepSeek-V3's router `e_score_correction_bias`), not the recomputed ones (RoPE).
    persistent = set(model.state_dict().keys())
    for name, buf in model.named_buffers():
        if name in persistent:
            yield name, buf.detach()


def stream_nbytes(pairs: list[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    """`(bytes of the stream, bytes the same weights take in BF16 without scales)`."""
    sent = sum(t.numel() * t.element_size() for _, t in pairs)
    bf16 = sum(t.numel() * 2 for name, t in pairs if not name.endswith("_scale_inv"))
    return sent, bf16


def iter_hp_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The high-precision stream: every parameter and checkpoint buffer as the learner holds it."""
    for name, param in model.named_parameters():
        yield name, param.detach()
    yield from _persistent_buffers(model)


@torch.no_grad()
def load_state_stream(model: nn.Module, pairs: list[tuple[str, torch.Tensor]]) -> None:
    """Copies a state stream into `model`'s parameters and buffers of the same names, all or nothing.

    Every pair is checked first (known name, same shape, same dtype) and every tensor of `model` must be covered
    (tied tensors once): a missing `weight_scale_inv` is an error, never a silent 1.0. Only then is anything copied,
    so a bad stream leaves `model` on its last good weights.
    """
    targets = model.state_dict(keep_vars=True)
    problems = []
    for name, tensor in pairs:
        target = targets.get(name)
        if target is None:
            problems.append(f"{name}: not a tensor of the sampler")
        elif tuple(tensor.shape) != tuple(target.shape) or tensor.dtype != target.dtype:
            problems.append(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the sampler holds {tuple(target.shape)} {target.dtype}"
            )
    covered = {targets[name].data_ptr() for name, _ in pairs if name in targets}
    missing = sorted({n for n, t in targets.items() if t.data_ptr() not in covered})
    if missing:
        problems.append(f"missing from the stream: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if problems:
        raise ValueError("refusing to load the FP8 state stream; nothing was changed:\n  " + "\n  ".join(problems))
    for name, tensor in pairs:
        targets[name].copy_(tensor)


def save_fp8_checkpoint(model: nn.Module, save_directory: str, recipe) -> list[str]:
    """Writes the stream as a block-FP8 checkpoint that vLLM serves and transformers loads: `model.safetensors`
    plus `config.json` with the recipe's `quantization_config` (the high-precision linears listed in
    `modules_to_not_convert`). Returns the names of the FP8 weights."""
    converted = getattr(model, "fp8_recipe", None) is not None
    tensors = dict(iter_fp8_state(model, None if converted else recipe))
    fp8_weights = [n[: -len("_scale_inv")] for n in tensors if n.endswith("_scale_inv")]
    fp8_modules = {n.rsplit(".", 1)[0] for n in fp8_weights}
    # nn.Linear subclasses too (Falcon's FalconLinear): whatever is not in FP8 must be listed for the loader.
    kept = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in fp8_modules]
    os.makedirs(save_directory, exist_ok=True)
    save_file(
        # Copies: sibling linears' FP8 weights are row views of one stacked tensor, which safetensors refuses.
        {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()},
        os.path.join(save_directory, "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = copy.deepcopy(model.config)
    config.quantization_config = recipe.to_quantization_config(modules_to_not_convert=kept)
    config.save_pretrained(save_directory)
    # vLLM and `generate()` read their sampling defaults and EOS ids from it, as from any transformers checkpoint.
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(save_directory)
    return fp8_weights
