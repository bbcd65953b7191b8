"""The two quantizations `FP8Linear` runs on every step, behind each backend: the readable reference everywhere, the
fused Triton kernels (bit-identical, NaN and inf included) where Triton runs."""

import functools
import os

import torch

from ..blockwise import _raise_nonfinite, quantize_blockwise


@functools.cache
def triton_status() -> tuple[bool, str]:
    """Whether the Triton kernels can run here, and why (not)."""
    try:
        import triton
    except ImportError:
        return False, "triton is not installed"
    if interpreting():
        return True, f"triton {triton.__version__} interpreter (TRITON_INTERPRET=1, CPU tensors)"
    if not torch.cuda.is_available():
        return False, "no CUDA device for triton"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return False, f"the GPU is SM{major}{minor}; these kernels need Hopper (SM90) or newer"
    return True, f"triton {triton.__version__} on SM{major}{minor}"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _use_triton(x: torch.Tensor, dims: tuple[int, ...] = (2,)) -> bool:
    return (x.is_cuda or interpreting()) and x.dim() in dims and triton_status()[0]


def reference_act(x2d: torch.Tensor, pow2_scales: bool, with_t: bool):
    q, s = quantize_blockwise(x2d, (1, 128), pow2_scales=pow2_scales, check_finite=False)
    if not with_t:
        return q, s, None, None
    qt, st = quantize_blockwise(x2d.t(), (1, 128), pow2_scales=pow2_scales, check_finite=False)
    return q, s, qt, st


def fast_act(x2d: torch.Tensor, pow2_scales: bool, with_t: bool):
    """X (M, K) -> `(q, scale_inv, qt, scale_inv_t)`: X in 1x128 blocks along K, and Xᵀ (K, M) in 1x128 blocks along
    M when `with_t` (wgrad's column-wise operand), in one pass where Triton runs. The Triton path pads (zero rows of
    q, zero columns of qt: see `triton_kernels.quantize_act`); GEMM callers slice their output to M rows."""
    if not _use_triton(x2d):
        return reference_act(x2d, pow2_scales, with_t)
    from .triton_kernels import quantize_act

    return quantize_act(x2d, pow2_scales=pow2_scales, with_t=with_t)


def _check_columns(x2ds: list[torch.Tensor]) -> None:
    widths = [x.shape[1] for x in x2ds]
    if any(w % 128 for w in widths) or len({x.shape[0] for x in x2ds}) != 1:
        raise ValueError(
            "quantize_act_columns takes members of one row count, each whole 128-column blocks (a block must not "
            f"straddle two), got shapes {[tuple(x.shape) for x in x2ds]}"
        )


def reference_act_columns(x2ds: list[torch.Tensor], pow2_scales: bool, with_t: bool):
    """`fast_act_columns` by the reference: each member alone, the row-wise usages side by side."""
    _check_columns(x2ds)
    outs = [reference_act(x, pow2_scales, with_t) for x in x2ds]
    # As bytes, which every torch's `cat` takes (CUDA's refused float8 up to torch 2.4 at least).
    q = torch.cat([o[0].view(torch.uint8) for o in outs], dim=1).view(torch.float8_e4m3fn)
    s = torch.cat([o[1] for o in outs], dim=1)
    return q, s, [o[2] for o in outs], [o[3] for o in outs]


def fast_act_columns(x2ds: list[torch.Tensor], pow2_scales: bool, with_t: bool):
    """X = [X_1 | ... | X_n] (each X_i (M, K_i) in whole 128-column blocks) -> `(q, scale_inv, qts, scale_inv_ts)`:
    X's row-wise usage as `fast_act(X)` gives it, written member by member without making X, and the column-wise
    usage Xᵢᵀ one per member (None without `with_t`). Stacked sibling linears' output gradients: one dgrad reads q,
    each member's wgrad its own Xᵢᵀ, whose scales are then in the layout cuBLAS reads (a row slice of one Xᵀ's are
    not)."""
    if not all(_use_triton(x) for x in x2ds):
        return reference_act_columns(x2ds, pow2_scales, with_t)
    from .triton_kernels import quantize_act_columns

    _check_columns(x2ds)
    return quantize_act_columns(x2ds, pow2_scales=pow2_scales, with_t=with_t)


def reference_weight(
    w: torch.Tensor,
    block: tuple[int, int],
    pow2_scales: bool,
    name: str,
    check_finite: bool = True,
    with_t: bool = False,
):
    """`(q, scale_inv, qt, scale_inv_t, amax)`: with `check_finite` the reference raises itself, naming `name`
    (amax is None); without, `amax` is W's absolute max (NaN and inf survive a max), for the caller to check when it
    syncs anyway. Wᵀ is a copy with `with_t`, else a view (see `fast_weight`)."""
    if w.dim() == 3:  # experts (E, N, K), each N whole row blocks: the (E * N, K) matrix's blocks are theirs
        e, n, k = w.shape
        if n % block[0]:
            raise ValueError(
                f"a stack of expert weights {tuple(w.shape)} must have whole {block[0]}-row blocks per expert"
            )
        q, s, _, _, amax = reference_weight(w.reshape(e * n, k), block, pow2_scales, name, check_finite)
        q, s = q.view(e, n, k), s.view(e, n // block[0], s.shape[-1])
    else:
        q, s = quantize_blockwise(w, block, pow2_scales=pow2_scales, check_finite=check_finite, name=name)
        amax = None if check_finite else w.detach().abs().amax()
    qt, st = q.transpose(-2, -1), s.transpose(-2, -1)
    return q, s, *((qt.contiguous(), st.contiguous()) if with_t else (qt, st)), amax


def fast_weight(
    w: torch.Tensor,
    block: tuple[int, int],
    pow2_scales: bool,
    name: str,
    check_finite: bool = True,
    with_t: bool = False,
):
    """W (N, K) in `block` blocks -> `(q, scale_inv, qt, scale_inv_t, block_amax)`. Wᵀ (`qt`, `scale_inv_t`), dgrad's
    operand, is contiguous with `with_t` (the K-major layout a GPU's FP8 MMA reads; the Triton kernel writes it in
    the same pass), else a view of `q` and `scale_inv`. With `check_finite`, NaN or inf raise a `ValueError` naming
    `name` (a host sync); without, the caller gets the block amax to check when it syncs anyway. A stack of experts'
    weights (E, N, K), N whole row blocks, gives stacks: q (E, N, K), Wᵀ per expert (E, K, N), and their scales.
    """
    if tuple(block) != (128, 128) or not _use_triton(w, dims=(2, 3)):
        return reference_weight(w, block, pow2_scales, name, check_finite, with_t)
    from .triton_kernels import quantize_weight

    q, s, qt, st, amax = quantize_weight(w, pow2_scales=pow2_scales, with_t=with_t)
    if check_finite:
        check_amax(amax, w, name)
        amax = None
    if not with_t:
        qt, st = q.transpose(-2, -1), s.transpose(-2, -1)
    return q, s, qt, st, amax


def _check_rows(ws: list[torch.Tensor]) -> None:
    if any(w.dim() != 2 or w.shape[0] % 128 for w in ws) or len({w.shape[1] for w in ws}) != 1:
        raise ValueError(
            "quantize_weight_rows takes 2-D members of one column count, each whole 128-row blocks (a block must not "
            f"straddle two), got shapes {[tuple(w.shape) for w in ws]}"
        )


def reference_weight_rows(ws: list[torch.Tensor], pow2_scales: bool, with_t: bool):
    """`fast_weight_rows` by the reference: the members' concatenation, quantized (the oracle may copy)."""
    _check_rows(ws)
    return reference_weight(torch.cat(ws), (128, 128), pow2_scales, "", check_finite=False, with_t=with_t)


def fast_weight_rows(ws: list[torch.Tensor], pow2_scales: bool, with_t: bool):
    """W = [W_1; ...; W_n] (each W_i (N_i, K) in whole 128-row blocks) -> `(q, scale_inv, qt, scale_inv_t, amax)`
    as `fast_weight(W, (128, 128), ..., check_finite=False)` gives them, written member by member without making W
    (stacked sibling linears' weights, quantized once per step; the caller checks `amax` when it syncs anyway)."""
    _check_rows(ws)
    if not all(_use_triton(w) for w in ws):
        return reference_weight_rows(ws, pow2_scales, with_t)
    from .triton_kernels import quantize_weight_rows

    q, s, qt, st, amax = quantize_weight_rows(ws, pow2_scales=pow2_scales, with_t=with_t)
    return (q, s, qt, st, amax) if with_t else (q, s, q.t(), s.t(), amax)


def check_amax(amax: torch.Tensor, x: torch.Tensor, name: str) -> None:
    """Raises the reference's `ValueError` naming `name` if a block amax of `x` is NaN or inf."""
    if not bool(torch.isfinite(amax).all()):
        _raise_nonfinite(x, name)
