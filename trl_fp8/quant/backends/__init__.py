"""FP8 backends behind one narrow interface, five functions per backend module:

- `gemm(a, a_scale_inv, b, b_scale_inv, b_block, out_dtype)`: `A @ B.T` for A (M, K) quantized in 1x128 blocks and
  B (N, K) in `b_block` blocks, both along K.
- `quantize_act(x2d, pow2_scales, with_t)`: X in 1x128 blocks along K, and Xᵀ in 1x128 blocks along M for wgrad;
  it may pad (zero rows of X, zero columns of Xᵀ) to the layout its `gemm` reads without copying, so callers slice a
  GEMM's output to their row count.
- `quantize_act_columns(x2ds, pow2_scales, with_t)`: `quantize_act` of the columns [X_1 | ... | X_n] without making
  them one tensor (stacked siblings' output gradients), with each member's Xᵢᵀ apart.
- `quantize_weight(w, block, pow2_scales, name, check_finite, with_t)`: W in `block` blocks -> `(q, scale_inv, qt,
  scale_inv_t, amax)`, refusing NaN/inf with the parameter's name, or handing back the block amax to check later
  (`amax` is else None). Wᵀ (dgrad's operand) is contiguous with `with_t`, else a view of `q`.
- `quantize_weight_rows(ws, pow2_scales, with_t)`: `quantize_weight` of the rows [W_1; ...; W_n] in 128x128 blocks
  without making them one tensor (stacked siblings' weights), `amax` always handed back.

The backends:

- `emulated`: reference quantization, dequantize + fp32 matmul, any device (the oracle).
- `torch`: `torch.nn.functional.scaled_mm` blockwise (cuBLAS), Hopper only; fused Triton quantization.
- `triton`: trl-fp8's own Triton block-scaled GEMM and fused quantization, Hopper and newer.
- `te`: TransformerEngine swaps whole modules instead of GEMMs (`trl_fp8.quant.te_linear`, chosen by
  `convert_to_fp8`); as a GEMM backend it raises.
"""

import logging
from types import ModuleType

import torch

from . import emulated, torch_scaled_mm, triton_gemm
from ._quantize import interpreting


logger = logging.getLogger(__name__)

BACKENDS: dict[str, ModuleType] = {
    "torch": torch_scaled_mm,
    "triton": triton_gemm,
    "emulated": emulated,
}  # fastest first
BACKEND_NAMES = ("auto", "emulated", "torch", "triton", "te")
_auto_logged: set[str] = set()


def available_backends(device: torch.device | None = None) -> dict[str, str]:
    """Maps each backend name to why it is or is not usable on `device` (or on this machine)."""
    out = {}
    for name, mod in BACKENDS.items():
        ok, why = mod.is_available(device)
        out[name] = ("available: " if ok else "unavailable: ") + why
    from ..te_linear import te_status

    ok, why = te_status()
    out["te"] = ("available: " if ok else "unavailable: ") + why + " (swaps whole modules: convert_to_fp8)"
    return out


def check_backend_name(name: str, where: str = "") -> str:
    """`name` if it is a backend's name, else a `ValueError` naming `where` (the module given it)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"{where + ': ' if where else ''}unknown FP8 backend {name!r}; choose one of {BACKEND_NAMES}")
    return name


def resolve_backend(name: str, device: torch.device | None = None) -> ModuleType:
    """Returns the backend module for `name` on `device`; `"auto"` picks the fastest usable one and logs it once."""
    check_backend_name(name)
    if name == "auto":
        for candidate, mod in BACKENDS.items():
            if device is not None and device.type != "cuda" and candidate != "emulated":
                continue
            if mod.is_available(device)[0]:
                key = f"{candidate}@{device}"
                if key not in _auto_logged:
                    _auto_logged.add(key)
                    logger.info("trl-fp8: backend='auto' picked %r for device %s", candidate, device)
                return mod
    if name == "te" and available_backends(device)["te"].startswith("available"):
        raise RuntimeError(
            "FP8 backend 'te' replaces whole modules, not GEMMs: convert with convert_to_fp8(model, "
            "FP8Recipe(backend='te'))"
        )
    mod = BACKENDS.get(name)
    ok, why = mod.is_available(device) if mod is not None else (False, "")
    if not ok:
        status = "\n".join(f"  {k}: {v}" for k, v in available_backends(device).items())
        raise RuntimeError(f"FP8 backend {name!r} cannot run here. Backends on this machine:\n{status}")
    if (
        device is not None
        and name != "emulated"
        and device.type != "cuda"
        and not (name == "triton" and interpreting())
    ):
        raise RuntimeError(f"FP8 backend {name!r} needs CUDA tensors, got tensors on {device}")
    if name == "triton" and device is not None and device.type != "cuda" and "interpreter" not in _auto_logged:
        _auto_logged.add("interpreter")
        # Its float8 cast does not carry a rounding into the exponent (31.78 -> 16): ~1% of codes differ.
        logger.warning(
            "trl-fp8: backend='triton' on %s runs Triton's interpreter (TRITON_INTERPRET=1), whose e4m3 cast is not "
            "exact: for testing the kernels' logic, not for training ('emulated' is the exact CPU path)",
            device,
        )
    return mod
