"""Triton kernels for the fast path: fused blockwise quantization (the GEMMs are in `triton_gemm_kernels.py`).

Each kernel computes exactly what `trl_fp8.quant.blockwise.quantize_blockwise` computes (fp32 math, correctly
rounded `448 / amax` via `div_rn`, pow2 scales by masking the mantissa, clamp, round-to-nearest-even cast), so their
output is bit-identical to the reference; the tests hold them to that, on CPU through Triton's interpreter
(`TRITON_INTERPRET=1`) and on a GPU for real. That includes NaN and inf: `tl.max` and `tl.minimum` drop NaN, so a
NaN activation would come out as -448 and a diverging run would train on finite garbage; the amax and the clamp here
keep NaN as the reference's do (a block holding one gets scale 1, its NaN stays NaN, inf clamps to +-448).

- `quantize_act`: one read of X (M, K) writes both usages TE's column-wise recipe needs: X in 1x128 blocks along K
  (fprop, dgrad) and Xᵀ (K, M) in 1x128 blocks along M (wgrad), the transpose fused into the same pass.
- `quantize_weight`: 128x128 blocks, with the block amax kept for the finiteness check, and Wᵀ (dgrad's K-major
  operand) written from the same registers; `quantize_weight_rows` writes stacked siblings' weights into one.
"""

import torch
import triton
import triton.language as tl

from ._quantize import interpreting


FP8_MAX: tl.constexpr = tl.constexpr(448.0)
# Read when Triton reads TRITON_INTERPRET: as the kernels are decorated, on import.
INTERPRETED: tl.constexpr = tl.constexpr(interpreting())
F32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _scale(amax, POW2: tl.constexpr):
    scale = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    scale = tl.where(scale == float("inf"), F32_MAX, scale)
    bad = (amax == 0) | (amax != amax) | (amax == float("inf"))
    scale = tl.where(bad, 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _cast(x, scale):
    y = tl.clamp(x * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if INTERPRETED:
        # PTX documents Hopper's convert (`cvt.rn.satfinite`) as keeping NaN, which the GPU tests check; the
        # interpreter's makes 384 of it. NaN's code is then set here, 0x7F as torch's cast of a positive NaN: a
        # select per element that the GPU does not pay for (13-22% more SASS instructions in the act kernel).
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(y != y, 0x7F, q).to(tl.float8e4nv, bitcast=True)
    return y.to(tl.float8e4nv)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax(x, axis: tl.constexpr):
    """max |x| along `axis`, NaN where a NaN is (`tl.max` would skip it, as `fmaxf` does)."""
    ax = tl.abs(x)
    if INTERPRETED:
        # The interpreter reduces through a jit combine function one element at a time (25x slower on the tests'
        # shapes); its `tl.max` is numpy's `nanmax`, fast but NaN-dropping, so a NaN flag puts NaN back.
        has_nan = tl.max((ax != ax).to(tl.int32), axis=axis) > 0
        return tl.where(has_nan, float("nan"), tl.max(ax, axis=axis))
    return tl.reduce(ax, axis, _max_nan)  # one max.NaN.f32 per step on SM90, as tl.max's max.f32


@triton.jit
def _load_slice(ptr, rows, cols, R, C, stride_r, stride_c):
    """Rows `rows` x columns `cols` of an (R, C) matrix, zeros outside it, in the matrix's own dtype."""
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    return tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)


@triton.jit
def _slice(ptr, x_next, rows, cols, R, C, stride_r, stride_c, CHUNK: tl.constexpr, PREFETCH: tl.constexpr):
    """`(slice, next)`: the slice at `rows` in fp32 and, with PREFETCH, the next slice's load issued before the
    caller stores this one's results (`x_next` holds this slice, loaded the same way the step before). The compiler
    may not move a load above a store to a pointer it cannot tell apart: without it each slice waits out a whole
    memory latency alone (SM90 SASS: a slice's 16-byte loads, its stores, then the next slice's loads). The last
    slice's prefetch, past the tile, is never used: the compiler drops it (`tests/test_sm90_static.py`)."""
    if PREFETCH:
        return x_next.to(tl.float32), _load_slice(ptr, rows + CHUNK, cols, R, C, stride_r, stride_c)
    return _load_slice(ptr, rows, cols, R, C, stride_r, stride_c).to(tl.float32), x_next


@triton.jit
def quant_act_kernel(
    x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr,
    M, K, M_Q, M_T, stride_xm, stride_xk, stride_qm, stride_sm, stride_sk, stride_stk, stride_stm,
    POW2: tl.constexpr, WITH_T: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    PREFETCH: tl.constexpr = False, RUNNING_MAX: tl.constexpr = False,
):  # fmt: skip
    # One program per 128x128 tile of X, walked in CHUNK-row slices so that few registers are live and many tiles
    # are in flight per SM (a whole fp32 tile per program is latency-bound at ~40% of copy bandwidth). The autotuner
    # picks CHUNK, PREFETCH (`_slice`) and RUNNING_MAX: Xᵀ's column amax kept per slice position and reduced across
    # rows once after pass 1, where a reduction per slice crosses warps through shared memory, with barriers (SM90:
    # 22% fewer instructions at 8 warps; at 4 warps the registers double).
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    # int64 offsets: M * K passes 2**31 at long contexts.
    row0 = pid_m.to(tl.int64) * BLOCK
    cols = pid_k.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    amax_c = tl.zeros((BLOCK,), dtype=tl.float32)
    amax_acc = tl.zeros((CHUNK, BLOCK), dtype=tl.float32)
    # Pass 1, row-wise usage X (M, K): a row's 128-column block lies whole in each slice.
    x_next = _load_slice(x_ptr, row0 + tl.arange(0, CHUNK), cols, M, K, stride_xm, stride_xk)
    for c in tl.static_range(BLOCK // CHUNK):
        rows = row0 + c * CHUNK + tl.arange(0, CHUNK)
        x, x_next = _slice(x_ptr, x_next, rows, cols, M, K, stride_xm, stride_xk, CHUNK, PREFETCH)
        scale_r = _scale(_amax(x, 1), POW2)
        # Rows M..M_Q are the zero padding (codes 0, scale_inv 1) that cuBLAS's layout wants: loaded as 0 above.
        q_mask = (rows[:, None] < M_Q) & (cols[None, :] < K)
        tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], _cast(x, scale_r[:, None]), mask=q_mask)
        tl.store(s_ptr + rows * stride_sm + pid_k * stride_sk, tl.math.div_rn(1.0, scale_r), mask=rows < M_Q)
        if WITH_T:
            if RUNNING_MAX:
                amax_acc = _max_nan(amax_acc, tl.abs(x))
            else:
                amax_c = _max_nan(amax_c, _amax(x, 0))
    if WITH_T:
        # Pass 2, column-wise usage Xᵀ (K, M): one scale per column of X and 128 rows, written transposed. The
        # slices are read again, from L2, unless one slice is the whole tile. (A pass 2 by column slices of all 128
        # rows, which writes Xᵀ in whole 128-byte lines, wrote non-zero codes into Xᵀ's padding on an H200:
        # benchmarks/RESULTS.md, 2026-12-04.)
        if RUNNING_MAX:
            amax_c = _amax(amax_acc, 0)
        scale_c = _scale(amax_c, POW2)
        if CHUNK < BLOCK:
            x_next = _load_slice(x_ptr, row0 + tl.arange(0, CHUNK), cols, M, K, stride_xm, stride_xk)
        for c in tl.static_range(BLOCK // CHUNK):
            rows = row0 + c * CHUNK + tl.arange(0, CHUNK)
            if CHUNK < BLOCK:
                x, x_next = _slice(x_ptr, x_next, rows, cols, M, K, stride_xm, stride_xk, CHUNK, PREFETCH)
            # else one slice is the whole tile: pass 1's `x`, still in registers, read once from memory in all.
            qt = tl.trans(_cast(x, scale_c[None, :]))
            # Xᵀ's rows are M_T = whole 128-blocks of tokens long, the padding zeros: wgrad's K needs no copy.
            t_mask = (cols[:, None] < K) & (rows[None, :] < M_T)
            tl.store(qt_ptr + cols[:, None] * M_T + rows[None, :], qt, mask=t_mask)
        tl.store(st_ptr + cols * stride_stk + pid_m * stride_stm, tl.math.div_rn(1.0, scale_c), mask=cols < K)


@triton.jit
def quant_weight_kernel(
    w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, amax_ptr, N, K, stride_wn, stride_wk, KB, T_ROWS, T_BLOCKS, stride_qt,
    stride_st, POW2: tl.constexpr, WITH_T: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    PREFETCH: tl.constexpr = False, RUNNING_MAX: tl.constexpr = False,
):  # fmt: skip
    # Wᵀ is written per T_ROWS rows of W (T_BLOCKS 128-row blocks): each expert of a stack (E * N, K) transposed on
    # its own, (E, K, N), as the grouped dgrad reads it; T_ROWS = N for one weight. A tile lies in one expert. Wᵀ's
    # rows are stride_qt codes (stride_st scales) apart: T_ROWS (T_BLOCKS), or more where Wᵀ is the columns of a
    # wider one (stacked siblings' weights, `quantize_weight_rows`).
    # PREFETCH and RUNNING_MAX as the act kernel's: pass 1 stores nothing, so only pass 2 needs the prefetch.
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    expert = (pid_n // T_BLOCKS).to(tl.int64)
    row0 = pid_n.to(tl.int64) * BLOCK
    cols = pid_k.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    amax_c = tl.zeros((BLOCK,), dtype=tl.float32)
    amax_acc = tl.zeros((CHUNK, BLOCK), dtype=tl.float32)
    for c in tl.static_range(BLOCK // CHUNK):
        rows = row0 + c * CHUNK + tl.arange(0, CHUNK)
        w = _load_slice(w_ptr, rows, cols, N, K, stride_wn, stride_wk).to(tl.float32)
        if RUNNING_MAX:
            amax_acc = _max_nan(amax_acc, tl.abs(w))
        else:
            amax_c = _max_nan(amax_c, _amax(w, 0))
    if RUNNING_MAX:
        amax_c = _amax(amax_acc, 0)
    amax = _amax(amax_c, 0)
    scale = _scale(amax, POW2)
    w_next = _load_slice(w_ptr, row0 + tl.arange(0, CHUNK), cols, N, K, stride_wn, stride_wk)
    for c in tl.static_range(BLOCK // CHUNK):
        rows = row0 + c * CHUNK + tl.arange(0, CHUNK)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        w, w_next = _slice(w_ptr, w_next, rows, cols, N, K, stride_wn, stride_wk, CHUNK, PREFETCH)
        q = _cast(w, scale)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
        if WITH_T:
            # Wᵀ (K, N), dgrad's K-major operand, from the codes in registers: a copy of W's codes afterwards
            # (`q.t().contiguous()`) ran at 0.35 TB/s on an H200 (benchmarks/RESULTS.md, 2026-12-04). The store is
            # the act kernel's pass 2, row slices written transposed.
            t_rows = rows - expert * T_ROWS
            t_mask = (cols[:, None] < K) & (rows[None, :] < N)
            t_ptrs = qt_ptr + expert * K * stride_qt + cols[:, None] * stride_qt + t_rows[None, :]
            tl.store(t_ptrs, tl.trans(q), mask=t_mask)
    scale_inv = tl.math.div_rn(1.0, scale)
    tl.store(s_ptr + pid_n * KB + pid_k, scale_inv)
    if WITH_T:
        tl.store(st_ptr + (expert * KB + pid_k) * stride_st + pid_n - expert * T_BLOCKS, scale_inv)
    tl.store(amax_ptr + pid_n * KB + pid_k, amax)


# Keyed without the token count M, which changes every RL step: one tuning per hidden size, not per batch. (CHUNK,
# warps, PREFETCH, RUNNING_MAX): the plain slices the H200 chose from on 2026-12-04 (CHUNK 32 at 4 warps won for
# the act kernel with Xᵀ), and the variants that compile to more loads in flight (16 at 4 warps: 128 registers, 4
# CTAs per SM still) or fewer instructions (8 warps: 22% fewer in the act kernel, 28-30% in the weight kernel, and
# no more registers): `python benchmarks/sm90_static.py`. Not yet timed; the autotuner keeps what runs fastest.
_CHUNKS = (
    (16, 4, False, False),
    (32, 4, False, False),
    (32, 8, False, False),
    (64, 8, False, False),
    (128, 8, False, False),
    (16, 4, True, False),
    (32, 8, True, True),
    (64, 8, True, True),
)
_QUANT_CONFIGS = [triton.Config({"CHUNK": c, "PREFETCH": p, "RUNNING_MAX": r}, num_warps=w) for c, w, p, r in _CHUNKS]


def _untimed(kernel_call, quantiles):
    """The interpreter cannot time kernels (and triton < 3.9 times even a single config left): every config ties."""
    return [0.0] * len(quantiles)


def _only_in_interpreter(kwargs: dict):
    """In the interpreter the autotuner keeps the one config `kwargs` names: the tests run the tuned launches."""

    def prune(configs, named_args, **_):
        return [c for c in configs if c.kwargs == kwargs] if interpreting() else configs

    return prune


# What Triton's CPU interpreter runs: whole tiles, its fastest (a 512x1024 act quantization in 0.65 s, 2.2 s in 32-row
# slices). `_UNTIMED` is read when Triton reads TRITON_INTERPRET: as kernels are decorated.
INTERPRETER_CONFIG = {"CHUNK": 128, "PREFETCH": False, "RUNNING_MAX": False}
_UNTIMED = {"do_bench": _untimed} if interpreting() else {}
quant_act_kernel_tuned = triton.autotune(
    configs=_QUANT_CONFIGS,
    key=["K", "WITH_T"],
    prune_configs_by={"early_config_prune": _only_in_interpreter(INTERPRETER_CONFIG)},
    **_UNTIMED,
)(quant_act_kernel)
quant_weight_kernel_tuned = triton.autotune(
    configs=_QUANT_CONFIGS,
    key=["K", "WITH_T"],
    prune_configs_by={"early_config_prune": _only_in_interpreter(INTERPRETER_CONFIG)},
    **_UNTIMED,
)(quant_weight_kernel)


def quantize_act(
    x: torch.Tensor,
    *,
    pow2_scales: bool = False,
    with_t: bool = True,
    config: dict | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """X (M, K) -> `(q, scale_inv, qt, scale_inv_t)`: X in 1x128 blocks along K, and Xᵀ in 1x128 blocks along M
    when `with_t`. Values equal `quantize_blockwise`'s.

    The layout is the one cuBLAS's blockwise kernel reads without a copy: scales are (rows, blocks) fp32 stored
    column-major; q has M rounded up to a multiple of 4 rows and Xᵀ is (K, M rounded up to a multiple of 128), the
    padding being zero codes with scale_inv 1. A GEMM's extra output rows are the caller's to drop; zero columns in
    a contraction add nothing. `out`: `(q, scale_inv)` to write X's row-wise usage into, views of that layout (the
    columns of a wider operand: `quantize_act_columns`)."""
    m, k = x.shape
    kb, mb = triton.cdiv(k, 128), triton.cdiv(m, 128)
    m_q, m_t = -(-m // 4) * 4, mb * 128
    if out is None:
        q = torch.empty((m_q, k), dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty_strided((m_q, kb), (1, m_q), dtype=torch.float32, device=x.device)
    else:
        q, s = out
    if with_t:
        qt = torch.empty((k, m_t), dtype=torch.float8_e4m3fn, device=x.device)
        st = torch.empty_strided((k, mb), (1, k), dtype=torch.float32, device=x.device)
    else:
        qt, st = q, s  # never written
    args = (
        x,
        q,
        s,
        qt,
        st,
        m,
        k,
        m_q,
        m_t,
        x.stride(0),
        x.stride(1),
        q.stride(0),
        s.stride(0),
        s.stride(1),
        st.stride(0),
        st.stride(1),
    )
    if config is not None:  # one kernel config (`CHUNK`, `num_warps`) instead of the autotuner's pick
        quant_act_kernel[(mb, kb)](*args, POW2=pow2_scales, WITH_T=with_t, BLOCK=128, **config)
    else:
        quant_act_kernel_tuned[(mb, kb)](*args, POW2=pow2_scales, WITH_T=with_t, BLOCK=128)
    return (q, s, qt, st) if with_t else (q, s, None, None)


def quantize_act_columns(
    xs: list[torch.Tensor], *, pow2_scales: bool = False, with_t: bool = True, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """X = [X_1 | ... | X_n] quantized as `quantize_act(X)` would, without making X: each X_i (M, K_i), K_i whole
    128-column blocks, is written into its columns of X's row-wise usage. Returns `(q, scale_inv, qts,
    scale_inv_ts)`, the column-wise usage one per member, each in `quantize_act`'s layout (stacked sibling linears'
    output gradients: one dgrad reads q, each member's wgrad its own Xᵢᵀ). `config` as `quantize_act`'s."""
    m = xs[0].shape[0]
    k, m_q = sum(x.shape[1] for x in xs), -(-m // 4) * 4
    q = torch.empty((m_q, k), dtype=torch.float8_e4m3fn, device=xs[0].device)
    s = torch.empty_strided((m_q, k // 128), (1, m_q), dtype=torch.float32, device=xs[0].device)
    qts, sts, c0 = [], [], 0
    for x in xs:
        c1 = c0 + x.shape[1]
        out = (q[:, c0:c1], s[:, c0 // 128 : c1 // 128])
        _, _, qt, st = quantize_act(x, pow2_scales=pow2_scales, with_t=with_t, config=config, out=out)
        qts.append(qt)
        sts.append(st)
        c0 = c1
    return q, s, qts, sts


def quantize_weight(
    w: torch.Tensor,
    *,
    pow2_scales: bool = False,
    with_t: bool = False,
    config: dict | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """W (N, K) -> `(q, scale_inv (ceil(N/128), ceil(K/128)), qt, scale_inv_t, block_amax)` in 128x128 blocks; with
    `with_t` also Wᵀ's codes (K, N) and scales (ceil(K/128), ceil(N/128)), contiguous, written in the same pass
    (else None). A stack of experts' weights (E, N, K), N whole 128-row blocks, is quantized in one launch as the
    (E * N, K) matrix it is, each expert's blocks its own: q (E, N, K), scales (E, N/128, ceil(K/128)), and Wᵀ per
    expert, (E, K, N). `config` as `quantize_act`'s. `out`: `(q, scale_inv, qt, scale_inv_t, block_amax)` of a 2-D W
    to write into, views of those layouts whose rows (of Wᵀ: columns) may be those of a wider one
    (`quantize_weight_rows`)."""
    stack = w.dim() == 3
    if stack and w.shape[1] % 128:
        raise ValueError(f"a stack of expert weights {tuple(w.shape)} must have whole 128-row blocks per expert")
    e, n, k = w.shape if stack else (1, *w.shape)
    w2 = w.reshape(e * n, k)
    nb, kb = triton.cdiv(e * n, 128), triton.cdiv(k, 128)
    if out is not None:
        q, s, qt, st, amax = out
        if not with_t:
            qt, st = q, s  # never written
        stride_qt, stride_st = qt.stride(0), st.stride(0)
    else:
        q = torch.empty((e * n, k), dtype=torch.float8_e4m3fn, device=w.device)
        s = torch.empty((nb, kb), dtype=torch.float32, device=w.device)
        amax = torch.empty((nb, kb), dtype=torch.float32, device=w.device)
        if with_t:
            qt = torch.empty((e, k, n), dtype=torch.float8_e4m3fn, device=w.device)
            st = torch.empty((e, kb, nb // e), dtype=torch.float32, device=w.device)
        else:
            qt, st = q, s  # never written
        stride_qt, stride_st = n, nb // e
    args = (w2, q, s, qt, st, amax, e * n, k, w2.stride(0), w2.stride(1), kb, n, nb // e, stride_qt, stride_st)
    if config is not None:
        quant_weight_kernel[(nb, kb)](*args, POW2=pow2_scales, WITH_T=with_t, BLOCK=128, **config)
    else:
        quant_weight_kernel_tuned[(nb, kb)](*args, POW2=pow2_scales, WITH_T=with_t, BLOCK=128)
    if out is not None:
        return out if with_t else (q, s, None, None, amax)
    shape, blocks = ((e, n, k), (e, nb // e, kb)) if stack else ((n, k), (nb, kb))
    q, s, amax = q.view(shape), s.view(blocks), amax.view(blocks)
    if not with_t:
        return q, s, None, None, amax
    return q, s, (qt if stack else qt[0]), (st if stack else st[0]), amax


def quantize_weight_rows(
    ws: list[torch.Tensor], *, pow2_scales: bool = False, with_t: bool = False, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """W = [W_1; ...; W_n] quantized as `quantize_weight(W)` would, without making W: each W_i (N_i, K), N_i whole
    128-row blocks, is written into its rows of W's codes, scales and block amax, and (`with_t`) its columns of
    Wᵀ. Stacked sibling linears' weights (q/k/v), whose concatenation in BF16 would be one more copy per step."""
    k = ws[0].shape[1]
    n = sum(w.shape[0] for w in ws)
    nb, kb, dev = n // 128, triton.cdiv(k, 128), ws[0].device
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=dev)
    s = torch.empty((nb, kb), dtype=torch.float32, device=dev)
    amax = torch.empty((nb, kb), dtype=torch.float32, device=dev)
    qt = torch.empty((k, n), dtype=torch.float8_e4m3fn, device=dev) if with_t else None
    st = torch.empty((kb, nb), dtype=torch.float32, device=dev) if with_t else None
    r0 = 0
    for w in ws:
        r1 = r0 + w.shape[0]
        b0, b1 = r0 // 128, r1 // 128
        out = (q[r0:r1], s[b0:b1], amax[b0:b1])
        out = (*out[:2], qt[:, r0:r1], st[:, b0:b1], out[2]) if with_t else (*out[:2], None, None, out[2])
        quantize_weight(w, pow2_scales=pow2_scales, with_t=with_t, config=config, out=out)
        r0 = r1
    return q, s, qt, st, amax
