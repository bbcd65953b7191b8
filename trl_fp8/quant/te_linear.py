"""The `te` backend: TransformerEngine's own linear (`transformer_engine.pytorch.Linear`) under `te.autocast` with a
`Float8BlockScaling` recipe, the kernels NeMo RL trains with (Hopper, CUDA >= 12.9).

Written against TransformerEngine 2.20's source; no machine this project tests on has TE, so the GPU tests in
`tests/test_te_backend.py` (marked `te`) are what verify it. What it takes care of:

- TE's fp32-scale switch is the environment variable `NVTE_FP8_BLOCK_SCALING_FP32_SCALES`, read once when TE is
  imported into class attributes of `Float8BlockScaling` (its constructor flag is ignored), so it depends on who
  imported TE first. The recipe's scale rule is set on the `Float8BlockScaling` instance instead (TE reads the
  `fp8_quant_*` parameters from the instance it is given), whatever the variable said.
- `te.autocast(recipe=None)` would pick DelayedScaling on Hopper: the recipe is always passed, with
  `backward_override=None` (its default is `NVTE_BACKWARD_OVERRIDE`, read at import, which can make the backward
  high precision).
- TE's block quantizer never yields a non-finite scale (NaN drops out of a block's amax; an inf amax gets scale 1),
  so the export checks the weight itself for NaN and inf, as the other backends' quantizer does.
- The swapped module keeps `weight` / `bias` names, and has no `_extra_state` entry (no framework-private state in
  checkpoints or in the sync stream).
- `quantized_weight()` returns TE's own block quantization of the weight (its `Float8BlockQuantizer`, the one its
  forward uses), so the sampler receives exactly the grid TE computed with.
- TE's block-scaled GEMMs need the token count to be a multiple of 16 (it is wgrad's leading dimension, and cuBLAS
  wants it 16-aligned; TE's own check only asks for 8): inputs are padded with zero rows, which add nothing.
- Without a bias, TE keeps an empty tensor as `bias`; it is set to `None`, as `nn.Linear` has it, so that nothing
  downstream (the sync stream above all) takes it for a bias.
- The swapped module holds copies of the weights (TE tags its own Parameters): build the optimizer after conversion,
  as `FP8GRPOTrainer` does.
- TE's linear returns a view it made inside its autograd function (`out.view(-1, ..., out_features)`), which autograd
  forbids modifying in place; OLMo 1.7's `clip_qkv` clamps q, k and v so. The output goes out through `modifiable`.
"""

import functools
import math
import sys

import torch
from torch import nn

from .blockwise import _raise_nonfinite
from .staleness import serial, weights_epoch


class _Modifiable(torch.autograd.Function):
    """Y = X, as a tensor over X's memory that autograd does not count as a view (no GEMM: an identity, dX = dY)."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, dy):
        return dy


def modifiable(y: torch.Tensor) -> torch.Tensor:
    """`y`, another library's autograd output, as a tensor a model may modify in place, copying nothing. A view made
    inside a custom autograd function (TE's linear returns one) cannot be: autograd refuses the in-place op."""
    return _Modifiable.apply(y)


# What this file was read against. 2.17-2.19 also have every name it uses (`constants.DType` since 2.17; 2.9-2.16 lack
# it); the floor stays at 2.20 until a TE run has tested them.
MIN_TE_VERSION = (2, 20)


@functools.cache
def te_status() -> tuple[bool, str]:
    """Whether TransformerEngine can run this recipe here, and why (not)."""
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        return False, 'transformer_engine is not installed (pip install "trl-fp8[te]", on a CUDA machine)'
    except Exception as err:  # a broken CUDA install surfaces here, not as ImportError
        return False, f"transformer_engine failed to import: {err}"
    version = _te_version(te)
    if version is None or version < MIN_TE_VERSION or not hasattr(te, "is_fp8_block_scaling_available"):
        shown = getattr(te, "__version__", None) or getattr(sys.modules.get("transformer_engine"), "__version__", "?")
        return False, f"TransformerEngine {shown} is too old for this backend (needs >= 2.20)"
    try:  # both ask the CUDA driver, and raise rather than answer where no GPU is visible
        ok, reason = te.is_fp8_block_scaling_available(return_reason=True)
        major, minor = torch.cuda.get_device_capability()
    except Exception as err:
        return False, f"TransformerEngine cannot query the GPU: {err}"
    if not ok:
        return False, f"TransformerEngine cannot run Float8BlockScaling here: {reason}"
    if major >= 10:
        return True, f"SM{major}{minor}: TransformerEngine emulates this recipe with MXFP8 and needs pow2_scales=True"
    return True, f"TransformerEngine on SM{major}{minor}"


def _te_version(te) -> tuple[int, int] | None:
    """(major, minor) of the installed TE, from `transformer_engine.pytorch` or the `transformer_engine` package."""
    from packaging.version import InvalidVersion, Version

    text = getattr(te, "__version__", None) or getattr(sys.modules.get("transformer_engine"), "__version__", None)
    try:
        return Version(text).release[:2] if text else None
    except InvalidVersion:
        return None


def te_recipe_status(pow2_scales: bool) -> tuple[bool, str]:
    """Whether TransformerEngine can run the recipe with this scale rule here, and why (not): `te_status`, and on
    Blackwell only with power-of-2 scales, since TE runs the recipe there as MXFP8, whose scales are powers of 2."""
    ok, why = te_status()
    if ok and not pow2_scales and torch.cuda.get_device_capability()[0] >= 10:
        return False, f"{why.split(':')[0]}: TransformerEngine runs this recipe as MXFP8 there, set pow2_scales=True"
    return ok, why


def te_block_recipe(pow2_scales: bool):
    """TE's `Float8BlockScaling` with the recipe's scale rule (fp32 or power-of-2 scales) for X, W and dY."""
    from transformer_engine.common.recipe import Float8BlockScaling, Format, QParams

    if not pow2_scales and torch.cuda.get_device_capability()[0] >= 10:
        raise RuntimeError("on Blackwell, TransformerEngine runs this recipe as MXFP8: set FP8Recipe.pow2_scales=True")
    # `backward_override` defaults to NVTE_BACKWARD_OVERRIDE, read when TE is imported: "high_precision" or
    # "dequantized" there would run dgrad and wgrad without the FP8 GEMMs. The recipe's backward is FP8.
    recipe = Float8BlockScaling(fp8_format=Format.E4M3, backward_override=None)
    qparams = QParams(power_2_scale=pow2_scales, amax_epsilon=0.0)
    recipe.fp8_quant_fwd_inp = recipe.fp8_quant_fwd_weight = recipe.fp8_quant_bwd_grad = qparams
    return recipe


@functools.cache
def te_linear_class() -> type:
    """`TEFP8Linear`, defined on first use so that importing trl_fp8 never imports TransformerEngine."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch import Float8BlockQuantizer
    from transformer_engine.pytorch.constants import DType

    class TEFP8Linear(te.Linear):
        """`te.Linear` running the recipe's blockwise FP8, swapped in for an `nn.Linear` of the same shape."""

        # nn.Module's own: no `_extra_state` key (TE keeps no state this recipe needs).
        get_extra_state = nn.Module.get_extra_state
        set_extra_state = nn.Module.set_extra_state

        @classmethod
        def from_linear(
            cls, linear: nn.Linear, *, pow2_scales: bool, name: str | None = None, device: torch.device | None = None
        ) -> "TEFP8Linear":
            """`linear`'s weights copied into a TE linear on `device` (where the model will train), else on theirs."""
            new = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                params_dtype=linear.weight.dtype,
                device=device if device is not None else linear.weight.device,
                init_method=lambda weight: None,  # copied over below: no init work, no draw from the CUDA RNG
            )
            with torch.no_grad():
                new.weight.copy_(linear.weight)
                if linear.bias is not None:
                    new.bias.copy_(linear.bias)
                else:
                    new.bias = None  # not TE's empty placeholder (TE reads it only with use_bias)
            new.weight.requires_grad_(linear.weight.requires_grad)
            if new.bias is not None:  # TE's own bias Parameter is trainable; a frozen one stays frozen
                new.bias.requires_grad_(linear.bias.requires_grad)
            new.te_recipe = te_block_recipe(pow2_scales)
            new.pow2_scales = pow2_scales
            new.fp8_name = f"{name}.weight" if name else "weight"
            new._w_cache = None
            new.train(linear.training)
            return new

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            x2d = x.reshape(-1, x.shape[-1])
            pad = -x2d.shape[0] % 16
            if pad:
                x2d = torch.nn.functional.pad(x2d, (0, 0, 0, pad))
            # TE allocates on the current device: a model spread over GPUs (`device_map`) runs each layer on its own.
            with torch.cuda.device(self.weight.device), te.autocast(enabled=True, recipe=self.te_recipe):
                y = super().forward(x2d, *args, **kwargs)
            return modifiable(y)[: y.shape[0] - pad].reshape(*x.shape[:-1], y.shape[-1])

        def _apply(self, fn, recurse=True):
            self._w_cache = None  # as FP8Linear's: after `.to()` the key may match a weight that changed
            return super()._apply(fn, recurse)

        @torch.no_grad()
        def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
            """TE's own 128x128 quantization of the weight: `(e4m3 (N, K), scale_inv (ceil(N/128), ceil(K/128)))`,
            cached until the weight changes."""
            w = self.weight
            key = (weights_epoch(), serial(w), w._version, w.data_ptr())
            if self._w_cache is None or self._w_cache[0] != key:
                # TE's block amax drops NaN (fmaxf) and an inf amax gets scale 1, so TE's scales are always finite:
                # the weight itself is checked, as FP8Linear's quantizer does.
                if not bool(torch.isfinite(w).all()):
                    _raise_nonfinite(w, self.fp8_name)
                quantizer = Float8BlockQuantizer(
                    DType.kFloat8E4M3,
                    rowwise=True,
                    columnwise=False,
                    block_scaling_dim=2,
                    force_pow_2_scales=self.pow2_scales,
                )
                with torch.cuda.device(w.device):
                    qt = quantizer(w)
                k_blocks = math.ceil(w.shape[1] / 128)
                # TE pads the K-block columns of the scales to a multiple of 4 for its GEMMs; checkpoints have none.
                q = qt._rowwise_data.view(torch.float8_e4m3fn)
                s = qt._rowwise_scale_inv[:, :k_blocks].contiguous()
                self._w_cache = (key, q, s)
            return self._w_cache[1], self._w_cache[2]

        def extra_repr(self) -> str:
            return (
                f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8=e4m3 w128x128/x1x128 (TransformerEngine), pow2_scales={self.pow2_scales}"
            )

    return TEFP8Linear


def is_te_linear(module: nn.Module) -> bool:
    return te_linear_class.cache_info().currsize > 0 and isinstance(module, te_linear_class())
