"""Triton block-scaled FP8 GEMMs: `A @ B.T` with per-(row, 128-K-block) A scales and 128x128 or 1x128 B scales,
applied to each fp32 partial product of one 128-deep K block (DeepSeek-V3's promotion scheme), and their grouped
forms for MoE experts. The operands come from `triton_kernels.py`'s quantizers; the tests hold the results to
`emulated` on the same FP8 operands.
"""

import os

import torch
import triton
import triton.language as tl

from ._quantize import interpreting
from .triton_kernels import _UNTIMED


@triton.jit
def gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk, SHAPE_BUCKET, TMA_OK,
    B_ROWS_PER_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    # TMA_OK (whether A and B meet TMA's 16-byte alignment) is read by the autotuner only: a key, and the pruning of
    # the TMA configs where it is 0.
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # Grouped launch order: consecutive programs share B tiles in L2.
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % group_size
    pid_n = (pid % (GROUP_M * grid_n)) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamped rows keep every load in bounds without masks on M and N; int64 because M * K passes 2**31.
    a_rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    b_rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    if TMA:
        # DeepGEMM's structure: one producer warp group streams A and B tiles by TMA into shared memory, and two
        # consumer warp groups each own half the tile's rows, so that while one scales its K block's product the
        # other's MMA runs (without warp specialization every warp waits on the same MMA). TMA zero-fills beyond M,
        # N and K, so no masks; the descriptors live in a global scratch from `triton.set_allocator`.
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=TMA):
        if TMA:
            a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).T
        else:
            k = kb * BLOCK_K + offs_k
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :] * stride_ak, mask=k[None, :] < K, other=0.0)
            b = tl.load(b_ptr + b_rows[None, :] * stride_bn + k[:, None] * stride_bk, mask=k[:, None] < K, other=0.0)
        a_s = tl.load(as_ptr + a_rows * stride_asm + kb * stride_ask)
        # Hopper waits for each K block's MMA before scaling its product, so the scaling is on the critical path:
        # one FMA per product (explicit: Triton stops fusing a multiply and an add by default), and where the tile's
        # columns share one weight scale (128x128 blocks), one scalar instead of a column vector held per thread.
        if B_ROWS_PER_SCALE % BLOCK_N == 0:
            b_s = tl.load(bs_ptr + (pid_n * BLOCK_N // B_ROWS_PER_SCALE) * stride_bsn + kb * stride_bsk)
            acc = tl.fma(tl.dot(a, b), (a_s * b_s)[:, None], acc)
        else:
            b_s = tl.load(bs_ptr + (b_rows // B_ROWS_PER_SCALE) * stride_bsn + kb * stride_bsk)
            acc = tl.fma(tl.dot(a, b), a_s[:, None] * b_s[None, :], acc)
    c = acc.to(c_ptr.dtype.element_ty)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    # int64 here too: M * N passes 2**31 (64k tokens through a 70B model's stacked gate/up).
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn, c, mask=mask)


# None of these spills more than a few registers on SM90 (compiled without a GPU: `python benchmarks/sm90_static.py`;
# 128x256 with 8 warps and 128x128 with 4 spilled 224-280 bytes a thread). The 64x128 and 128x64 tiles fit two CTAs
# per SM (with 128x128 weight scales), so that one CTA's scaling can overlap the other's MMAs; the autotuner times
# which wins.
# The TMA configs are warp-specialized: 4 warps name the producer's group, and Triton adds the two consumer groups
# (12 warps in all, registers rebalanced to the consumers by `setmaxnreg`); 128x128 is the widest tile whose
# consumers do not spill.
configs = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "TMA": tma}, num_warps=w, num_stages=s)
    for bm, bn, w, s, tma in (
        (128, 128, 8, 3, False),
        (128, 128, 8, 4, False),
        (64, 128, 8, 4, False),
        (64, 128, 4, 4, False),
        (128, 64, 4, 3, False),
        (128, 128, 4, 3, True),
        (128, 128, 4, 4, True),
        (128, 128, 4, 5, True),
    )
]


def _prune_configs(configs, named_args, **kwargs):
    """The TMA configs only for operands TMA can read (`TMA_OK`). Triton's CPU interpreter cannot time kernels: there
    the first config left runs, through the autotuner all the same (so the tests run the tuned launches)."""
    keep = [c for c in configs if named_args["TMA_OK"] or not c.kwargs["TMA"]]
    return keep[:1] if interpreting() else keep


_AUTOTUNE = dict(prune_configs_by={"early_config_prune": _prune_configs}, **_UNTIMED)


# The token count is M in fprop/dgrad and K in wgrad, and changes every RL step: tuning is keyed on the shape rounded
# to powers of two (`SHAPE_BUCKET`), so a new batch length does not re-tune.
gemm_kernel_tuned = triton.autotune(configs=configs, key=["SHAPE_BUCKET", "B_ROWS_PER_SCALE", "TMA_OK"], **_AUTOTUNE)(
    gemm_kernel
)


def _shape_bucket(m: int, n: int, k: int) -> int:
    """One int naming (M, N, K) rounded up to powers of two: log2 values packed 8 bits each."""
    return sum(max(0, (v - 1).bit_length()) << shift for v, shift in ((m, 16), (n, 8), (k, 0)))


def _tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the warp-specialized TMA configs may run: TMA reads rows at 16-byte aligned addresses (not broadcast),
    contiguous along K, on an NVIDIA GPU that has TMA (Hopper and newer; the interpreter emulates it).

    On a GPU only with `TRL_FP8_TRITON_TMA=1`, for work on these kernels: on an H200 (triton 3.6.0, 2026-12-04) they
    gave products 0 dB from `emulated`'s, where the plain configs, from the same kernel code, gave 78 dB; the
    interpreter runs them right. `TRL_FP8_TRITON_TMA=0` leaves them out there too. Read at every launch."""
    switch = os.environ.get("TRL_FP8_TRITON_TMA")
    if switch == "0":
        return False
    aligned = all(
        t.stride(1) == 1 and t.stride(0) > 0 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, b)
    )
    if interpreting():
        return aligned
    on_hopper = a.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(a.device)[0] >= 9
    return switch == "1" and aligned and on_hopper


def _tma_refusal(a: torch.Tensor, b: torch.Tensor) -> str:
    """Why `_tma_ok(a, b)` said no, for the error of a launch that asked for a TMA config."""
    switch = os.environ.get("TRL_FP8_TRITON_TMA")
    if switch == "0" or (switch != "1" and not interpreting()):
        return f"the TMA configs are off (TRL_FP8_TRITON_TMA={switch}; on a GPU they run only with 1)"
    return (
        f"TMA cannot read these operands (A strides {tuple(a.stride())}, B strides {tuple(b.stride())}; rows must "
        "start at 16-byte aligned addresses, on a GPU with TMA)"
    )


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # the caching allocator aligns to 512 bytes


def _ensure_allocator() -> None:
    """The TMA configs write their descriptors to a global scratch that Triton asks an allocator for. Triton keeps
    it in a context variable, which every thread (autograd's backward threads too) starts without: set ours where
    none is set, and leave one the user set alone."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_block: tuple[int, int],
    out_dtype: torch.dtype,
    config: dict | None = None,
) -> torch.Tensor:
    """`A @ B.T` for A (M, K) in 1x128 blocks and B (N, K) in 128x128 or 1x128 blocks -> (M, N) in `out_dtype`.
    `config` (`BLOCK_M`, `BLOCK_N`, `GROUP_M`, `TMA`, and on a GPU `num_warps`, `num_stages`) runs one kernel config
    instead of the autotuner's pick (in the interpreter: the first config, see `_prune_configs`)."""
    if tuple(b_block) not in ((128, 128), (1, 128)):
        raise ValueError(f"the triton backend takes 128x128 or 1x128 blocks for B, got {tuple(b_block)}")
    m, k = a.shape
    n = b.shape[0]
    if b.stride(1) != 1:
        # Hopper's FP8 MMA reads both operands K-major; one transposing copy beats a strided load in every tile. Its
        # rows start 16 bytes apart, so that TMA can read it whatever K is.
        b = torch.empty((n, -(-k // 16) * 16), dtype=b.dtype, device=b.device)[:, :k].copy_(b)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    tma_ok = _tma_ok(a, b)
    args = (
        a, b, c, a_scale_inv, b_scale_inv, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        c.stride(0), c.stride(1), a_scale_inv.stride(0), a_scale_inv.stride(1), b_scale_inv.stride(0),
        b_scale_inv.stride(1), _shape_bucket(m, n, k), int(tma_ok),
    )  # fmt: skip
    if config is not None:
        config = {"TMA": False, **config}
        if config["TMA"] and not tma_ok:
            raise ValueError(f"config TMA=True, but {_tma_refusal(a, b)}")
    if tma_ok and not interpreting():
        _ensure_allocator()
    if config is not None:
        grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
        gemm_kernel[grid](*args, B_ROWS_PER_SCALE=b_block[0], BLOCK_K=128, **config)
    else:

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        gemm_kernel_tuned[grid](*args, B_ROWS_PER_SCALE=b_block[0], BLOCK_K=128)
    return c


@triton.jit
def grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, tile_expert_ptr, M, N, K, E,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, TMA_OK,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    # Rows of A come grouped by expert in 128-aligned segments: every M tile belongs to one expert, whose B it uses.
    # A tile of expert E (none: padding, dropped pairs) skips the K loop and stores zeros. With TMA (warp-specialized
    # as in `gemm_kernel`), B is read as (E * N, K): a tile's rows past N are the next expert's, and their output
    # columns are masked at the store.
    tl.static_assert(128 % BLOCK_N == 0, "a tile's columns must share one 128x128 weight block's scale")
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m * BLOCK_M // 128).to(tl.int64)
    k_blocks = tl.where(expert < E, tl.cdiv(K, BLOCK_K), 0)
    expert = tl.minimum(expert, E - 1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    b_rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    b_base = b_ptr + expert * stride_be
    bs_base = bs_ptr + expert * stride_bse
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, [E * N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, k_blocks, warp_specialize=TMA):
        if TMA:
            a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            b = b_desc.load([(expert * N + pid_n * BLOCK_N).to(tl.int32), kb * BLOCK_K]).T
        else:
            k = kb * BLOCK_K + offs_k
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak, mask=k[None, :] < K, other=0.0)
            b = tl.load(b_base + b_rows[None, :] * stride_bn + k[:, None] * stride_bk, mask=k[:, None] < K, other=0.0)
        a_s = tl.load(as_ptr + offs_m * stride_asm + kb * stride_ask)
        b_s = tl.load(bs_base + (pid_n * BLOCK_N // 128) * stride_bsn + kb * stride_bsk)  # as in `gemm_kernel`
        acc = tl.fma(tl.dot(a, b), (a_s * b_s)[:, None], acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(
        c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def grouped_wgrad_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, seg_ptr, N, K,
    stride_an, stride_at, stride_bk, stride_bt, stride_ce, stride_cn, stride_ck,
    stride_asn, stride_ast, stride_bsk, stride_bst, M, TMA_OK,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    # dW[e] = Aᵀ-segment · Bᵀ-segment over expert e's 128-token blocks [seg[e], seg[e+1]).
    expert, pid = tl.program_id(0), tl.program_id(1)
    grid_k = tl.cdiv(K, BLOCK_K)
    pid_n, pid_k = pid // grid_k, pid % grid_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    rows_k = tl.where(offs_k < K, offs_k, 0).to(tl.int64)
    start, end = tl.load(seg_ptr + expert), tl.load(seg_ptr + expert + 1)
    if TMA:  # M: the token count, whole 128-blocks
        a_desc = tl.make_tensor_descriptor(a_ptr, [N, M], [stride_an, 1], [BLOCK_N, 128])
        b_desc = tl.make_tensor_descriptor(b_ptr, [K, M], [stride_bk, 1], [BLOCK_K, 128])
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for tb in tl.range(start, end, warp_specialize=TMA):
        if TMA:
            a = a_desc.load([pid_n * BLOCK_N, tb * 128])
            b = b_desc.load([pid_k * BLOCK_K, tb * 128]).T
        else:
            t = (tb * 128 + tl.arange(0, 128)).to(tl.int64)
            a = tl.load(a_ptr + rows_n[:, None] * stride_an + t[None, :] * stride_at)
            b = tl.load(b_ptr + rows_k[None, :] * stride_bk + t[:, None] * stride_bt)
        a_s = tl.load(as_ptr + rows_n * stride_asn + tb * stride_ast)
        b_s = tl.load(bs_ptr + rows_k * stride_bsk + tb * stride_bst)
        acc = tl.fma(tl.dot(a, b), a_s[:, None] * b_s[None, :], acc)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    c = c_ptr + expert.to(tl.int64) * stride_ce + offs_n[:, None] * stride_cn + offs_k[None, :] * stride_ck
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)


# The grouped kernels' tiles are 128x128 (a tile of A must lie within one expert's 128-aligned segment); the
# autotuner picks between the plain kernel and the warp-specialized TMA one, per (N, K): M changes every step.
grouped_configs = [
    triton.Config({"TMA": tma}, num_warps=w, num_stages=s) for tma, w, s in ((False, 8, 3), (True, 4, 3), (True, 4, 4))
]
_tuned = dict(key=["N", "K", "TMA_OK"], **_AUTOTUNE)
grouped_gemm_kernel_tuned = triton.autotune(configs=grouped_configs, **_tuned)(grouped_gemm_kernel)
grouped_wgrad_kernel_tuned = triton.autotune(configs=grouped_configs, **_tuned)(grouped_wgrad_kernel)


def _launch_grouped(kernel, tuned, grid, args, tma, blocks, fixed):
    """The autotuner's pick, or with `tma` True/False the TMA/plain kernel (64-wide tiles in the interpreter);
    `args` end with `TMA_OK`, `blocks` names the tile's sizes, `fixed` holds the other constexprs."""
    tma_ok = args[-1]
    if tma and not tma_ok:
        a, b = args[0], args[1]
        raise ValueError(f"tma=True, but {_tma_refusal(a, b)}")
    if tma_ok and not interpreting():
        _ensure_allocator()
    if tma is None:
        tuned[grid(128)](*args, **dict.fromkeys(blocks, 128), **fixed)
    elif interpreting():
        kernel[grid(64)](*args, TMA=tma, **dict.fromkeys(blocks, 64), **fixed)
    else:
        options = dict(num_warps=4, num_stages=3) if tma else dict(num_warps=8, num_stages=3)
        kernel[grid(128)](*args, TMA=tma, **dict.fromkeys(blocks, 128), **fixed, **options)


def grouped_gemm(a, a_scale_inv, b, b_scale_inv, tile_expert, out_dtype, tma: bool | None = None):
    """`C[rows of e] = A[rows of e] @ B[e].T` for A (M, K) in 1x128 blocks, grouped by expert in 128-row-aligned
    segments (`tile_expert[i]`: the expert of rows 128i..128i+127, E for rows of none, which get zeros), and B
    (E, N, K) in 128x128 blocks. `tma` forces the TMA kernel (True) or the plain one (False) instead of the
    autotuner's pick."""
    m, k = a.shape
    n = b.shape[1]
    if b.stride(2) != 1 or b.stride(0) != n * b.stride(1):
        b = b.contiguous()  # K-major for the FP8 MMA, experts back to back for TMA
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    tma_ok = int(_tma_ok(a, b[0]) and b.shape[0] * n < 2**31)
    args = (
        a, b, c, a_scale_inv, b_scale_inv, tile_expert, m, n, k, b.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        a_scale_inv.stride(0), a_scale_inv.stride(1),
        b_scale_inv.stride(0), b_scale_inv.stride(1), b_scale_inv.stride(2), tma_ok,
    )  # fmt: skip

    def grid(block):
        return (triton.cdiv(m, block), triton.cdiv(n, block))

    _launch_grouped(
        grouped_gemm_kernel,
        grouped_gemm_kernel_tuned,
        grid,
        args,
        tma,
        ("BLOCK_M", "BLOCK_N"),
        {"BLOCK_K": 128},
    )
    return c


def grouped_wgrad(at, at_scale_inv, bt, bt_scale_inv, segments, num_experts, out_dtype, tma: bool | None = None):
    """`dW[e] = At[:, seg e] @ Bt[:, seg e].T` for At (N, M) and Bt (K, M) in 1x128 blocks along M, expert e's
    tokens being the 128-blocks `segments[e]:segments[e+1]`. Returns (E, N, K); experts without tokens get zeros.
    `tma` as in `grouped_gemm`."""
    n, k = at.shape[0], bt.shape[0]
    c = torch.empty((num_experts, n, k), dtype=out_dtype, device=at.device)
    args = (
        at, bt, c, at_scale_inv, bt_scale_inv, segments, n, k,
        at.stride(0), at.stride(1), bt.stride(0), bt.stride(1), c.stride(0), c.stride(1), c.stride(2),
        at_scale_inv.stride(0), at_scale_inv.stride(1), bt_scale_inv.stride(0), bt_scale_inv.stride(1), at.shape[1],
        int(_tma_ok(at, bt)),
    )  # fmt: skip

    def grid(block):
        return (num_experts, triton.cdiv(n, block) * triton.cdiv(k, block))

    _launch_grouped(grouped_wgrad_kernel, grouped_wgrad_kernel_tuned, grid, args, tma, ("BLOCK_N", "BLOCK_K"), {})
    return c
