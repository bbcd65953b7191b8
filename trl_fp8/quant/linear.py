"""`FP8Linear`: an `nn.Linear` whose three GEMMs run on blockwise-E4M3 operands.

The module keeps its master weight in its own dtype (the optimizer never sees FP8) and caches the quantized weight
while the weight is unchanged (its version counter), so micro-batches, the old-logprob pass and the export stream
all reuse one quantization per optimizer step. Being an `nn.Linear` subclass that holds the very same `weight` and
`bias` Parameters, a swapped-in `FP8Linear` changes no parameter name, `state_dict` key or optimizer state.
"""

import functools
import weakref

import torch
from torch import nn

from .backends import check_backend_name, resolve_backend
from .backends._quantize import check_amax
from .staleness import mark_weights_changed, serial, weights_epoch


def autocast_input(x: torch.Tensor, where: str) -> torch.Tensor:
    """`x` in the surrounding autocast's dtype, as `nn.Linear` and TE's linear see it under autocast: quantized from
    that dtype and answered in it (the cast is autograd's, so dX comes back in `x`'s own dtype). Anything but a
    floating-point tensor is refused, naming the layer (`where`): token ids passed where hidden states belong."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{where}: expected a floating-point input tensor, got {got}")
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if x.dtype != dtype:
            return x.to(dtype)
    return x


def is_sharded(p: torch.Tensor, module: nn.Module | None = None) -> bool:
    """Whether `p` is whole only while gathered: a DeepSpeed ZeRO-3 parameter (`ds_id`: whole while its module runs,
    or inside `deepspeed.zero.GatheredParameters`), or a weight of a `module` that `mark_sharded` marked (FSDP2
    swaps a whole plain tensor, which bears no mark, into the module while its unit runs). FP8 modules do not cache
    its quantization, which would keep a whole FP8 copy of every layer, what sharding avoids (quantizing anew gives
    the same bits)."""
    # `vars`, not `getattr`: a module's missing attribute costs an exception, on every forward of every linear.
    return hasattr(p, "ds_id") or (module is not None and vars(module).get("fp8_sharded", False))


def full_shape(p: torch.Tensor) -> torch.Size:
    """`p`'s shape, whole: a sharded DeepSpeed ZeRO-3 parameter holds an empty tensor outside a gather (an FSDP2
    `DTensor` gives its whole shape itself)."""
    return p.ds_shape if hasattr(p, "ds_id") else p.shape


def as_output(y: torch.Tensor) -> torch.Tensor:
    """`y` as a custom Function's output that the model may still modify in place (OLMo's `clip_qkv` clamps q, k
    and v with `clamp_`): autograd forbids that on a view made inside the Function (`[:m]` dropping a backend's
    padded rows, the reshape to the input's shape). `detach()` gives a tensor over the same memory that autograd does
    not count as a view, copying nothing; always, since a `_is_view()` test would break `torch.compile`'s graph."""
    return y.detach()


def first_order_only(backward):
    """Marks the `backward` of an FP8 autograd function, whose gradients are FP8 GEMMs without a graph: it refuses to
    run under `create_graph=True`. `once_differentiable` would answer and fail only a later `.backward()` through its
    answer; `torch.autograd.grad` prunes its error node (which has no edges) and silently leaves the FP8 terms out of
    a second-order gradient."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():  # autograd runs a backward in grad mode only under create_graph=True
            raise RuntimeError(
                "FP8 layers are differentiable once: their backward GEMMs build no graph, so create_graph=True "
                "(double backward, gradient penalties, Hessian-vector products) is not supported through them; "
                "compute such gradients with the layers in high precision"
            )
        return backward(ctx, *grads)

    return wrapper


def version_of(x: torch.Tensor) -> int | None:
    """`x`'s version counter, or None for a tensor made under `torch.inference_mode()`, which keeps none."""
    return None if x.is_inference() else x._version


class _SharedActivation:
    """The last input quantized, and its quantization: q, k and v (gate and up) read one X, which is then quantized
    once for the three, and the three wgrads share one saved Xᵀ (a kernel and an activation's memory saved per
    sibling). Matched by identity and version counter, so an in-place change of X re-quantizes; held by weak
    reference, so the entry goes when X does. Writes that bypass the version counter (`x.data`, DLPack aliases)
    are not seen: the model's activations are fresh tensors, but a caller reusing an input buffer must not do that."""

    entry: tuple | None = None

    @classmethod
    def quantize(cls, backend, x: torch.Tensor, x2d: torch.Tensor, pow2_scales: bool, with_t: bool):
        e, version = cls.entry, version_of(x)
        # Nothing to match by, or outputs that autograd must never save (made in inference mode): quantized alone.
        if version is None or torch.is_inference_mode_enabled():
            return backend.quantize_act(x2d, pow2_scales, with_t)
        if e is not None and e[0]() is x and e[1:4] == (version, backend, pow2_scales) and (e[4] or not with_t):
            return e[5]
        out = backend.quantize_act(x2d, pow2_scales, with_t)
        cls.entry = (weakref.ref(x, cls._forget), version, backend, pow2_scales, with_t, out)
        return out

    @classmethod
    def _forget(cls, ref: weakref.ref) -> None:
        if cls.entry is not None and cls.entry[0] is ref:
            cls.entry = None


class _FP8LinearFunction(torch.autograd.Function):
    """Y = X · Wᵀ (+ b) with FP8 operands in all three GEMMs (M tokens, K = in_features, N = out_features):

    - fprop: Y[M, N]  = X[M, K] · W[N, K]ᵀ     X in 1x128 blocks along K, W in 128x128 blocks
    - dgrad: dX[M, K] = dY[M, N] · W[N, K]     dY in 1x128 blocks along N; Wᵀ: W's FP8 bits and scales transposed
      (passed in; for a sharded weight (ZeRO-3, FSDP2), `None`: W is saved and quantized again here, the same bits)
    - wgrad: dW[N, K] = dY[M, N]ᵀ · X[M, K]    dYᵀ and Xᵀ in 1x128 blocks along M, the token dim (TE's column-wise
      usage; X is quantized this way from the high-precision input in forward, never re-quantized from FP8)

    Every GEMM accumulates in fp32; the bias and its gradient stay in high precision. The backend's quantizer may pad
    M (zero rows; zero columns of Xᵀ and dYᵀ) to its GEMM's layout: fprop and dgrad drop the extra output rows.
    """

    @staticmethod
    def forward(
        ctx, x, weight, bias, w_fp8, w_scale_inv, w_fp8_t, w_scale_inv_t, w_block, backend, pow2_scales, wgrad=True
    ):
        x2d = x.reshape(-1, x.shape[-1])
        m = x2d.shape[0]
        # One pass makes both usages: X for fprop, Xᵀ for wgrad (only when a backward will want the weight's gradient:
        # not in the no-grad old-logprob and reference forwards, which `wgrad=False` marks).
        x_fp8, x_scale_inv, xt_fp8, xt_scale_inv = _SharedActivation.quantize(
            backend, x, x2d, pow2_scales, wgrad and weight.requires_grad
        )
        # [M, K] @ [K, N] -> [M, N]
        y = backend.gemm(x_fp8, x_scale_inv, w_fp8, w_scale_inv, w_block, x.dtype)[:m]
        if bias is not None:
            y = y + bias.to(y.dtype)
        # Without Wᵀ (a sharded weight: ZeRO-3, FSDP2) W itself is saved: DeepSpeed or FSDP gathers it again for
        # this module's backward, where it is quantized anew (the same bits), so no whole FP8 copy of every layer's
        # weight waits from forward to backward.
        ctx.requantize = w_fp8_t is None
        ctx.save_for_backward(weight if ctx.requantize else w_fp8_t, w_scale_inv_t, xt_fp8, xt_scale_inv)
        ctx.backend, ctx.pow2_scales, ctx.w_block = backend, pow2_scales, w_block
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        return as_output(y.reshape(*x.shape[:-1], y.shape[-1]))

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        saved_w, w_scale_inv_t, xt_fp8, xt_scale_inv = ctx.saved_tensors  # saved_w: FP8 Wᵀ, or W to requantize
        backend, pow2 = ctx.backend, ctx.pow2_scales
        dy2d = dy.reshape(-1, dy.shape[-1])
        m = dy2d.shape[0]
        dx = dw = db = None
        dy_fp8, dy_scale_inv, dyt_fp8, dyt_scale_inv = backend.quantize_act(dy2d, pow2, ctx.needs_input_grad[1])
        if ctx.needs_input_grad[0]:
            w_fp8_t = saved_w
            if ctx.requantize:  # W itself, which DeepSpeed (or FSDP) gathered again for this backward
                _, _, w_fp8_t, w_scale_inv_t, _ = backend.quantize_weight(
                    saved_w.detach(), ctx.w_block, pow2, "", check_finite=False, with_t=saved_w.is_cuda
                )
            # [M, N] @ [N, K] -> [M, K]: B = Wᵀ (K, N) with its 128x128 blocks transposed
            w_block_t = (ctx.w_block[1], ctx.w_block[0])
            dx = backend.gemm(dy_fp8, dy_scale_inv, w_fp8_t, w_scale_inv_t, w_block_t, ctx.x_dtype)
            dx = dx[:m].reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # [N, M] @ [M, K] -> [N, K]
            dw = backend.gemm(dyt_fp8, dyt_scale_inv, xt_fp8, xt_scale_inv, (1, 128), ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2d.sum(0)
        return dx, dw, db, None, None, None, None, None, None, None, None


class FP8Linear(nn.Linear):
    """`nn.Linear` with blockwise-FP8 fprop, dgrad and wgrad.

    Args:
        in_features (`int`), out_features (`int`), bias (`bool`), device, dtype:
            As for `nn.Linear`.
        backend (`str`, *optional*, defaults to `"auto"`):
            GEMM backend: `"auto"`, `"emulated"`, `"torch"` or `"triton"` (see `trl_fp8.quant.backends`). Resolved on
            the first forward, for the device of the input; `"auto"` takes `"emulated"` for weight blocks other than
            128x128.
        pow2_scales (`bool`, *optional*, defaults to `False`):
            Round every scale down to a power of two.
        weight_block_size (`tuple[int, int]`, *optional*, defaults to `(128, 128)`):
            Block of one weight scale over (out_features, in_features).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        backend: str = "auto",
        pow2_scales: bool = False,
        weight_block_size: tuple[int, int] = (128, 128),
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.pow2_scales = pow2_scales
        self.fp8_name = "weight"  # the weight's name in the model, set by `from_linear`: errors name the layer
        self._w_cache: tuple | None = None
        # Set by `trl_fp8.quant.siblings.FP8SiblingGroup` when this linear runs stacked with its siblings (q/k/v).
        self._siblings, self._sibling_index = None, 0
        self.weight_block_size = weight_block_size
        self.backend = backend

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        backend: str = "auto",
        pow2_scales: bool = False,
        weight_block_size: tuple[int, int] = (128, 128),
        name: str | None = None,
    ) -> "FP8Linear":
        """Zero-copy swap: the new module holds `linear`'s own `weight` and `bias` Parameters."""
        with torch.device("meta"):
            new = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                backend=backend,
                pow2_scales=pow2_scales,
                weight_block_size=weight_block_size,
            )
        new.weight = linear.weight
        new.bias = linear.bias
        new.fp8_name = f"{name}.weight" if name else "weight"
        new.train(linear.training)
        return new

    def to_linear(self) -> nn.Linear:
        """The plain `nn.Linear` holding the same Parameters (for BF16 evaluation or export)."""
        with torch.device("meta"):
            lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        lin.weight, lin.bias = self.weight, self.bias
        return lin

    @torch.no_grad()
    def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(weight_fp8 (N, K), weight_scale_inv (ceil(N / block_rows), ceil(K / block_cols)))`, cached until the
        weight changes: an optimizer step, an in-place write (version counter), a new tensor or
        `mark_weights_changed()` (writes through `.data` bypass the version counter); never for a sharded weight
        (`is_sharded`: ZeRO-3, FSDP2). The cache itself is returned:
        read it, never write it. Raises a `ValueError` naming the parameter if the weight holds NaN or inf."""
        q, s, _, _ = self._quantized(check_finite=True)
        return q, s

    def _quantized(self, check_finite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(weight_fp8, weight_scale_inv, weight_fp8ᵀ, weight_scale_invᵀ)`; the transposes are dgrad's operands
        (contiguous on GPUs, whose FP8 MMA reads both operands K-major: made once per step, not once per backward).

        A forward never waits on the host for the NaN/inf check (a sync per layer would stall the GPU between
        layers): the quantizer hands back the amax, checked at the next `quantized_weight()`, which every sampler
        sync and the export call, so a non-finite weight never reaches the sampler."""
        if (group := self._group()) is not None:
            return group.member_weight(self._sibling_index, check_finite)
        w, entry = self.weight, self._w_cache
        # The hit of every forward between two optimizer steps skips the grad-mode switches of a miss: where small
        # batches leave the GPU waiting on the host, microseconds per linear add up.
        if entry is not None and (not check_finite or entry[5] is None) and entry[0] == self._weight_key(w):
            if not is_sharded(w, self):
                return entry[1:5]
        return self._quantize_weight(check_finite)

    def _weight_key(self, w: torch.Tensor) -> tuple:
        return (weights_epoch(), serial(w), w._version, w.data_ptr(), w.device, w.dtype, self.pow2_scales)

    @torch.inference_mode(False)  # a cache filled in inference mode would hold tensors autograd cannot save
    @torch.no_grad()  # inside: inference_mode(False) turns grad mode back on
    def _quantize_weight(self, check_finite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        w = self.weight
        sharded = is_sharded(w, self)
        key = self._weight_key(w)
        entry = self._w_cache
        if sharded or entry is None or entry[0] != key:
            backend = self._backend_for(w.device)
            contiguous = w.is_cuda and w.requires_grad and not sharded  # (a sharded weight's backward makes its own)
            entry = (key,) + backend.quantize_weight(
                w, self.weight_block_size, self.pow2_scales, self.fp8_name, check_finite, with_t=contiguous
            )
        if check_finite and entry[5] is not None:
            check_amax(entry[5], w, self.fp8_name)
            entry = (*entry[:5], None)
        if not sharded:
            self._w_cache = entry
        return entry[1:5]

    def _group(self):
        """The sibling group this very module belongs to: a `DataParallel` replica (a shallow copy) has its
        original's group in its `__dict__` but is not its member, and runs alone."""
        group = self._siblings
        if group is None or group.member(self._sibling_index) is not self:
            return None
        if any(m is None for m in group.members):
            # A copy of this linear alone (deepcopy, torch.save) copied its group too, whose other members nobody
            # holds: dead references never come back, so it leaves the group for good.
            self._siblings, self._sibling_index = None, 0
            return None
        return group

    def __getstate__(self):
        # Copies and pickles (deepcopy, torch.save) carry neither the backend modules (not picklable) nor the cache.
        return {**self.__dict__, "_backends": {}, "_w_cache": None}

    def _apply(self, fn, recurse=True):
        # `.to()`, `.half()`, `.cuda()` put the new tensor in through `param.data = ...`, which keeps the version
        # counter, and the new storage may take the old address: the cache keys cannot tell the weight changed.
        self._w_cache = None
        if self._siblings is not None:
            self._siblings.drop_caches()
        # A PEFT LoRA layer over this one caches its merged weight and never sees a move of its base alone.
        mark_weights_changed()
        return super()._apply(fn, recurse)

    @property
    def backend(self) -> str:
        """The backend's name. Setting it (also after a forward) checks the name and drops what the old backend
        resolved and quantized; stacked siblings (q/k/v) run as one GEMM, so they must all be given the same one."""
        return self._backend_name

    @backend.setter
    def backend(self, name: str) -> None:
        self._backend_name = check_backend_name(name, self._where())
        self._forget_quantization()

    @property
    def weight_block_size(self) -> tuple[int, int]:
        """Block of one weight scale; may be changed after a forward, as `backend` (stacked siblings need 128x128)."""
        return self._weight_block_size

    @weight_block_size.setter
    def weight_block_size(self, block: tuple[int, int]) -> None:
        # Checked here, not at the next quantization, where the error would surface inside a training step.
        block = tuple(block) if isinstance(block, (tuple, list)) else (block,)
        if len(block) != 2 or any(type(b) is not int or b < 1 for b in block):
            raise ValueError(f"{self._where()}: weight_block_size must be two positive ints, got {block}")
        self._weight_block_size = block
        self._forget_quantization()

    def _where(self) -> str:
        # The layer's name for errors: its weight's name without ".weight" (set by `from_linear`).
        return self.fp8_name.removesuffix("weight").removesuffix(".") or "FP8Linear"

    def _forget_quantization(self) -> None:
        # What was resolved or quantized under the old setting: `auto` resolves by block size.
        self._backends: dict[torch.device, object] = {}
        self._w_cache = None
        if self._siblings is not None:
            self._siblings.drop_caches()

    def _backend_for(self, device: torch.device):
        if device not in self._backends:
            # Only the oracle takes weight blocks other than 128x128: `auto` must not pick a GEMM that refuses them.
            auto_other_block = self.backend == "auto" and self.weight_block_size != (128, 128)
            self._backends[device] = resolve_backend("emulated" if auto_other_block else self.backend, device)
        return self._backends[device]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (group := self._group()) is not None:
            return group.forward(self, x)
        w_fp8, w_scale_inv, w_fp8_t, w_scale_inv_t = self._quantized(check_finite=False)
        if is_sharded(self.weight, self):
            w_fp8_t = w_scale_inv_t = None
        return _FP8LinearFunction.apply(
            autocast_input(x, self._where()),
            self.weight,
            self.bias,
            w_fp8,
            w_scale_inv,
            w_fp8_t,
            w_scale_inv_t,
            self.weight_block_size,
            self._backend_for(x.device),
            self.pow2_scales,
            torch.is_grad_enabled(),
        )

    def extra_repr(self) -> str:
        br, bc = self.weight_block_size
        fp8 = f"fp8=e4m3 w{br}x{bc}/x1x128, backend={self.backend}, pow2_scales={self.pow2_scales}"
        return f"{super().extra_repr()}, {fp8}"
