"""GEMM backends behind one narrow interface: `gemm(a, a_scale_inv, b, b_scale_inv, b_block, out_dtype)` computes
`A @ B.T` for A (M, K) quantized in 1x128 blocks and B (N, K) in `b_block` blocks, both along K.

- `emulated`: dequantize + fp32 matmul, any device (the oracle).
- `torch`: `torch.nn.functional.scaled_mm` blockwise, Hopper only.
- `te`: TransformerEngine swaps whole modules instead of GEMMs and arrives in its own change; asking for it raises.
"""

import logging
from types import ModuleType

import torch

from . import emulated, torch_scaled_mm


logger = logging.getLogger(__name__)

BACKENDS: dict[str, ModuleType] = {"torch": torch_scaled_mm, "emulated": emulated}  # fastest first
BACKEND_NAMES = ("auto", "emulated", "torch", "te")
_auto_logged: set[str] = set()


def available_backends(device: torch.device | None = None) -> dict[str, str]:
    """Maps each backend name to why it is or is not usable on `device` (or on this machine)."""
    out = {}
    for name, mod in BACKENDS.items():
        ok, why = mod.is_available(device)
        out[name] = ("available: " if ok else "unavailable: ") + why
    out["te"] = "unavailable: the TransformerEngine backend is not part of this version of trl-fp8"
    return out


def resolve_backend(name: str, device: torch.device | None = None) -> ModuleType:
    """Returns the backend module for `name` on `device`; `"auto"` picks the fastest usable one and logs it once."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown FP8 backend {name!r}; choose one of {BACKEND_NAMES}")
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
    mod = BACKENDS.get(name)
    ok, why = mod.is_available(device) if mod is not None else (False, "")
    if not ok:
        status = "\n".join(f"  {k}: {v}" for k, v in available_backends(device).items())
        raise RuntimeError(f"FP8 backend {name!r} cannot run here. Backends on this machine:\n{status}")
    if device is not None and name != "emulated" and device.type != "cuda":
        raise RuntimeError(f"FP8 backend {name!r} needs CUDA tensors, got tensors on {device}")
    return mod
