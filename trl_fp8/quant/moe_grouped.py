"""The grouped fast path of `FP8Experts`: all experts of a layer in one kernel per GEMM instead of a loop.

Routed (token, k) pairs are copied into one buffer, grouped by expert, each expert's segment starting on a multiple
of 128 rows (zero rows fill the gaps). Then every 128-row tile belongs to one expert, and one pass of the fused
quantizer over the buffer gives exactly the per-expert quantizations: rows are quantized alone along K, and the
column-wise (wgrad) blocks of 128 tokens never straddle two experts; the zero rows raise no amax. The GEMMs are the
grouped Triton kernels of `backends/triton_gemm_kernels.py`. Numerically this is the per-expert path of `moe.py`,
summed in another order (the tests hold the two together).
"""

from typing import NamedTuple

import torch

from .backends._quantize import fast_act
from .linear import first_order_only


class ExpertGroups(NamedTuple):
    dest: torch.Tensor  # (P,) buffer row of each routed pair, pairs in expert order (dropped pairs last)
    token: torch.Tensor  # (P,) its token
    pos: torch.Tensor  # (P,) its top-k slot
    tile_expert: torch.Tensor  # (rows / 128,) int32: the expert of each 128-row tile, num_experts for none
    segments: torch.Tensor  # (E + 1,) int32: each expert's first 128-row tile; the last entry ends expert E - 1
    rows: int


@torch.no_grad()
def group_by_expert(top_k_index: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Where each routed (token, k) pair of `top_k_index` (T, k) goes in the 128-aligned expert-grouped buffer.

    No host sync: the buffer is sized for the worst case, `T * k` pairs plus 127 padding rows for each expert and
    for the dropped pairs (index `num_experts`, which some models use and transformers' loop skips). Dropped pairs
    and the tail past the last expert sit in tiles of expert `num_experts`, which the grouped kernels give zero
    outputs, so they add nothing. Sizing the buffer exactly took host syncs in every MoE layer and pass (boolean
    masks, `bincount`, `repeat_interleave`, an `int()`), each stalling the CPU that queues the kernels."""
    pairs, k = top_k_index.numel(), top_k_index.shape[1]
    device = top_k_index.device
    flat = top_k_index.flatten().long().clamp(max=num_experts)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    tiles = (counts + 127) // 128
    ends = torch.cumsum(tiles, 0)
    first_tile, first_pair = ends - tiles, torch.cumsum(counts, 0) - counts
    dest = first_tile[expert] * 128 + torch.arange(pairs, device=device) - first_pair[expert]
    max_tiles = (pairs + 127 * (num_experts + 1)) // 128
    tile_expert = torch.searchsorted(ends, torch.arange(max_tiles, device=device), right=True)
    tile_expert = tile_expert.clamp(max=num_experts).to(torch.int32)
    return ExpertGroups(dest, order // k, order % k, tile_expert, first_tile.to(torch.int32), max_tiles * 128)


class _GroupedFP8Function(torch.autograd.Function):
    """Y[rows of e] = X[rows of e] · W[e]ᵀ for every expert e at once (M buffer rows, K in, N out, E experts):

    - fprop: Y[M, N]     = X[M, K] · W[e][N, K]ᵀ    X in 1x128 blocks along K, W[e] in 128x128 blocks
    - dgrad: dX[M, K]    = dY[M, N] · W[e][N, K]    dY in 1x128 blocks along N, W[e]ᵀ (cached K-major; for sharded
      weights quantized again here from the experts DeepSpeed or FSDP gathers again, the same bits)
    - wgrad: dW[e][N, K] = dY_eᵀ[N, M_e] · X_e[M_e, K]   dYᵀ and Xᵀ in 1x128 blocks along each expert's tokens

    Tiles of no expert (`tile_expert` = E) get zero outputs in fprop and dgrad and are left out of wgrad.

    Every GEMM accumulates in fp32, the scales applied per 128-deep K block.
    """

    @staticmethod
    def forward(ctx, x, weight, w_fp8, w_scale_inv, w_fp8_t, tile_expert, segments, pow2_scales, wgrad, again=None):
        from .backends.triton_gemm_kernels import grouped_gemm

        x_fp8, x_scale_inv, xt_fp8, xt_scale_inv = fast_act(x, pow2_scales, wgrad and weight.requires_grad)
        y = grouped_gemm(x_fp8, x_scale_inv, w_fp8, w_scale_inv, tile_expert, x.dtype)
        # `again`: (experts, which) to ask for Wᵀ in the backward, when no FP8 copy may wait for it (sharded weights).
        ctx.again = again
        ctx.save_for_backward(w_fp8_t, w_scale_inv, xt_fp8, xt_scale_inv, tile_expert, segments)
        ctx.pow2_scales, ctx.x_dtype, ctx.w_dtype, ctx.num_experts = (
            pow2_scales,
            x.dtype,
            weight.dtype,
            weight.shape[0],
        )
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        from .backends.triton_gemm_kernels import grouped_gemm, grouped_wgrad

        w_fp8_t, w_scale_inv, xt_fp8, xt_scale_inv, tile_expert, segments = ctx.saved_tensors
        dy_fp8, dy_scale_inv, dyt_fp8, dyt_scale_inv = fast_act(
            dy.contiguous(), ctx.pow2_scales, ctx.needs_input_grad[1]
        )
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if ctx.again is not None:
                _, _, w_fp8_t = ctx.again[0].quantized_with_t(ctx.again[1])
            dx = grouped_gemm(dy_fp8, dy_scale_inv, w_fp8_t, w_scale_inv.transpose(1, 2), tile_expert, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = grouped_wgrad(dyt_fp8, dyt_scale_inv, xt_fp8, xt_scale_inv, segments, ctx.num_experts, ctx.w_dtype)
        return dx, dw, None, None, None, None, None, None, None, None


def grouped_experts_forward(experts, hidden_states, top_k_index, top_k_weights, out_dtype=None):
    """`FP8Experts.forward` on the grouped kernels: same inputs and output as transformers' experts modules (the sum
    over experts in `out_dtype`, by default the input's)."""
    groups = group_by_expert(top_k_index, experts.num_experts)
    x = hidden_states.new_zeros(groups.rows, hidden_states.shape[-1])
    x = x.index_copy(0, groups.dest, hidden_states[groups.token])

    def linear(x, which):
        weight, again = getattr(experts, which), None
        if experts.requantizes_in_backward(which):
            (q, s), qt, again = experts.quantized(which, check_finite=False), None, (experts, which)
        else:
            q, s, qt = experts.quantized_with_t(which)
        return _GroupedFP8Function.apply(
            x, weight, q, s, qt, groups.tile_expert, groups.segments, experts.pow2_scales, torch.is_grad_enabled(),
            again,
        )  # fmt: skip

    # Padding rows are never read back (`y[groups.dest]`), and rows do not mix in a GEMM, whatever the activation
    # makes of them.
    y = linear(experts.activation(linear(x, "gate_up_proj")), "down_proj")
    weights = top_k_weights[groups.token, groups.pos, None]
    # Dropped pairs' rows are zeros; whatever their weight (0 * inf is NaN), they count for nothing, as in the loop.
    weights = torch.where(top_k_index[groups.token, groups.pos, None] < experts.num_experts, weights, 0)
    y = y[groups.dest] * weights
    out = torch.zeros_like(hidden_states, dtype=out_dtype)
    return out.index_add(0, groups.token, y.to(out.dtype))
