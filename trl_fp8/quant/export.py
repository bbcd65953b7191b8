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

from collections.abc import Iterator

import torch
from torch import nn

from .blockwise import quantize_blockwise
from .convert import select_fp8_linears
from .linear import FP8Linear


def iter_fp8_state(model: nn.Module, recipe=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields the stream of `model` (unwrapped: no DDP `module.` prefix). Tied parameters appear once."""
    to_quantize: set[str] = set()
    if recipe is not None:
        to_quantize = set(select_fp8_linears(model, recipe)[0])
    done: set[str] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, FP8Linear):
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
    for name, param in model.named_parameters():
        if name not in done:
            yield name, param.detach()


def stream_nbytes(pairs: list[tuple[str, torch.Tensor]]) -> tuple[int, int]:
    """`(bytes of the stream, bytes the same weights take in BF16 without scales)`."""
    sent = sum(t.numel() * t.element_size() for _, t in pairs)
    bf16 = sum(t.numel() * 2 for name, t in pairs if not name.endswith("_scale_inv"))
    return sent, bf16
