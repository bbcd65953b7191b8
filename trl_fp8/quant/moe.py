"""Mixture-of-Experts in FP8: transformers' fused experts (`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)).

Experts in another layout (GPT-OSS: transposed, biased, gate and up interleaved) stay in high precision
(`unsupported_experts_layout` says why). The activation is the model's own (`_apply_gate`: transformers' SwiGLU,
or DeepSeek-V4's and HY-V4's clamped one), in the learner and in the sampler.

Each expert's matrix is quantized in its own 128x128 blocks (the quantizer blocks the last two dims, so an (E, N, K)
tensor is E independent weights). With I a multiple of 128, the blocks of the fused `gate_up_proj` never straddle
gate and up, so slicing its quantization gives exactly what quantizing `gate_proj` and `up_proj` alone gives: the
per-expert checkpoint tensors vLLM loads (`...mlp.experts.{e}.gate_proj.weight` + `weight_scale_inv`).

- `FP8Experts` (learner): the fused Parameters, unchanged, with every expert GEMM (forward, dgrad, wgrad) in FP8:
  one grouped kernel per GEMM for all experts on the fast backends (`moe_grouped.py`), a loop over experts on the
  `emulated` oracle.
- `W8A8Experts` (sampler): per-expert `W8A8Linear`s in checkpoint names, vLLM's numerics.
The router stays in high precision in both (it is not a fused-experts module).
"""

import inspect
from contextlib import contextmanager

import torch
from torch import nn

from .backends import check_backend_name, resolve_backend
from .backends._quantize import check_amax, triton_status
from .linear import _FP8LinearFunction, autocast_input, full_shape, is_sharded
from .moe_grouped import grouped_experts_forward
from .staleness import serial, weights_epoch
from .w8a8 import W8A8Linear


def is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and len(full_shape(gate_up)) == 3


def unsupported_experts_layout(module: nn.Module) -> str | None:
    """Why `FP8Experts` cannot stand in for these fused experts, or None if it can. It runs transformers' standard
    layout: `gate_up_proj` (E, 2I, H) with gate and up concatenated, `down_proj` (E, H, I), no biases, no norm
    after each expert, called as `experts(hidden_states, top_k_index, top_k_weights)`; the flags are the ones
    transformers' `use_experts_implementation` sets on the module."""
    gate_up, down = full_shape(module.gate_up_proj), full_shape(module.down_proj)
    reasons = []
    if getattr(module, "is_transposed", False):
        reasons.append("transposed weights")
    if getattr(module, "has_bias", False) or any(p is not None and "bias" in n for n, p in module._parameters.items()):
        reasons.append("biases")
    if not getattr(module, "is_concatenated", True):
        reasons.append("gate and up interleaved")
    if getattr(module, "has_post_expert_norm", False):
        reasons.append("a norm after each expert")
    e, two_i, hidden = gate_up
    if not reasons and (two_i % 2 or tuple(down) != (e, hidden, two_i // 2)):
        reasons.append(f"gate_up_proj {tuple(gate_up)} and down_proj {tuple(down)} are not (E, 2I, H), (E, H, I)")
    positional = [
        p
        for p in inspect.signature(module.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if len(positional) < 3 and not any(p.kind == p.VAR_POSITIONAL for p in positional):
        reasons.append("called without the router's top-k indices and weights")
    if getattr(type(module), "_apply_gate", None) is None and not callable(getattr(module, "act_fn", None)):
        reasons.append("no act_fn or _apply_gate")
    return f"{type(module).__name__}: {', '.join(reasons)}" if reasons else None


class ExpertsGate:
    """The experts' own activation of a `gate_up_proj` output, for the modules that stand in for them."""

    def take_gate(self, experts: nn.Module) -> None:
        """Takes the experts' class's `_apply_gate` (transformers installs its default, `act_fn(gate) * up`, on every
        experts class it dispatches; DeepSeek-V4 and HY-V4 clamp first) with the attributes and parameter-free
        submodules it reads (`act_fn`, `limit`), shared, not copied. Nothing this module already has is replaced: an
        instance `forward` that accelerate's hooks put on the experts would otherwise bypass the FP8 GEMMs. The
        submodules are not registered, so that `W8A8Experts`, a list of experts, holds experts only."""
        self.experts_class = type(experts)
        children = {
            name: child for name, child in experts.named_children() if not any(True for _ in child.parameters())
        }
        for name, value in {**vars(experts), **children}.items():
            if name.startswith("_") or hasattr(self, name) or isinstance(value, torch.Tensor):
                continue
            self.__dict__[name] = value

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_fn = getattr(self.experts_class, "_apply_gate", None)
        if gate_fn is None:  # a fused-experts class that transformers does not dispatch
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up
        return gate_fn(self, gate_up)


def _route(num_experts: int, top_k_index: torch.Tensor):
    """Yields `(expert, top_k_pos, token_idx)` for every expert that received tokens (transformers' loop)."""
    with torch.no_grad():
        expert_mask = nn.functional.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit[:, 0].tolist():
        if e < num_experts:
            top_k_pos, token_idx = torch.where(expert_mask[e])
            yield e, top_k_pos, token_idx


class FP8Experts(ExpertsGate, nn.Module):
    """Fused experts with blockwise-FP8 GEMMs; holds the original module's Parameters (zero copy)."""

    def __init__(self, experts: nn.Module, *, backend: str = "auto", pow2_scales: bool = False, name: str = ""):
        super().__init__()
        why = unsupported_experts_layout(experts)
        if why is not None:
            raise ValueError(f"FP8Experts cannot run {name or 'these experts'} ({why})")
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.num_experts = full_shape(self.gate_up_proj)[0]
        self.pow2_scales, self.fp8_name = pow2_scales, name
        self.backend = backend
        self.take_gate(experts)

    def __getstate__(self):
        # Copies and pickles carry neither the backend modules (not picklable) nor the caches.
        return {**self.__dict__, "_backends": {}, "_cache": {}}

    def _apply(self, fn, recurse=True):
        self._cache = {}  # as FP8Linear's: after `.to()` the keys may match a weight that changed
        return super()._apply(fn, recurse)

    @torch.no_grad()
    def quantized(self, which: str, check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """`(q (E, N, K), scale_inv (E, N/128, K/128))` of `gate_up_proj` or `down_proj`, cached like FP8Linear. The
        NaN/inf check (a host sync) is FP8Linear's too: deferred from the forward passes to the next call with
        `check_finite` (every export and sampler sync), which names the Parameter."""
        return self._quantized(which, check_finite)[:2]

    @torch.no_grad()
    def quantized_with_t(self, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`quantized(which)` plus the transposed codes (E, K, N), K-major for the grouped dgrad; once per step."""
        return self._quantized(which, check_finite=False, with_t=True)

    @torch.inference_mode(False)  # as FP8Linear's: a cache filled in inference mode would hold tensors autograd cannot
    @torch.no_grad()  # save (the next training step failed); inside: inference_mode(False) turns grad mode back on
    def _quantized(self, which: str, check_finite: bool, with_t: bool = False):
        w = getattr(self, which)
        key, sharded = (weights_epoch(), serial(w), w._version, w.data_ptr(), self.pow2_scales), is_sharded(w, self)
        entry = self._cache.get(which)
        if not sharded and entry is not None and entry[0] == key and with_t and entry[3] is None:
            # Quantized where the grouped path did not run (or for the export) and now asked for Wᵀ: from the codes.
            entry = (*entry[:3], entry[1].transpose(1, 2).contiguous(), entry[4])
        if sharded or entry is None or entry[0] != key:
            # Every expert's rows are whole 128-row blocks (conversion checks), so the experts stacked as one
            # (E * N, K) matrix quantize exactly as each alone: one launch of the backend's weight kernel for all,
            # which on a GPU also writes each expert's Wᵀ for the grouped dgrad (a transposing copy afterwards ran
            # at 0.35 TB/s on an H200).
            t = with_t or (w.is_cuda and w.requires_grad and not sharded and self._grouped(w.device))
            q, s, qt, _, amax = self._backend(w.device).quantize_weight(
                w.detach(), (128, 128), self.pow2_scales, "", check_finite=False, with_t=t
            )
            entry = (key, q, s, qt if t else None, amax)
        key, q, s, qt, amax = entry
        if check_finite and amax is not None:
            check_amax(amax, w, f"{self.fp8_name}.{which}")
            entry = (key, q, s, qt, None)
        if not sharded:  # as FP8Linear's: no cache of a sharded weight
            self._cache[which] = entry
        return q, s, qt

    @property
    def backend(self) -> str:
        """The backend's name; setting it (also after a forward) checks it and drops the old backend's
        quantizations."""
        return self._backend_name

    @backend.setter
    def backend(self, name: str) -> None:
        self._backend_name = check_backend_name(name, self.fp8_name or "FP8Experts")
        self._backends: dict[torch.device, object] = {}
        self._cache: dict[str, tuple] = {}

    def _backend(self, device: torch.device):
        if device not in self._backends:
            self._backends[device] = resolve_backend(self.backend, device)
        return self._backends[device]

    def _grouped(self, device: torch.device) -> bool:
        """Whether the experts run on the grouped kernels here (whose dgrad reads each expert's Wᵀ K-major)."""
        return self._backend(device).name in ("torch", "triton") and triton_status()[0]

    def requantizes_in_backward(self, which: str) -> bool:
        """Whether the backward quantizes `which` again rather than keep its FP8 transpose from the forward: a
        sharded weight (`is_sharded`), which DeepSpeed or FSDP gathers again for the backward."""
        return is_sharded(getattr(self, which), self)

    def _linear(self, x, which: str, e: int):
        fused, backend, sharded = getattr(self, which), self._backend(x.device), self.requantizes_in_backward(which)
        weight = fused[e]  # a view: its gradient lands in the fused Parameter
        if sharded:  # nothing cached: this expert alone (the same bits as stacked)
            q, s, qt, st, _ = backend.quantize_weight(
                weight.detach(), (128, 128), self.pow2_scales, "", check_finite=False
            )
        else:
            q, s = (t[e] for t in self.quantized(which, check_finite=False))
            # Wᵀ stays a view of the FP8 weight here; a backend that needs it K-major copies it.
            qt, st = q.t(), s.t()
        # Quantized again from the expert's weight, a view saved for the backward: under FSDP2 only, which refills
        # the very storage the view reads (DeepSpeed gathers into new storage, and the view would keep the old one).
        if sharded and not hasattr(fused, "ds_id"):
            qt = st = None
        return _FP8LinearFunction.apply(
            x, weight, None, q, s, qt, st, (128, 128), backend, self.pow2_scales, torch.is_grad_enabled()
        )

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # The fast backends run every expert of the layer in one grouped kernel per GEMM (moe_grouped.py); the
        # emulated oracle loops over experts, as transformers does.
        # Under autocast the GEMMs read the autocast dtype, as transformers' experts do; their sum keeps the input's.
        x, dtype = autocast_input(hidden_states, self.fp8_name or "FP8Experts"), hidden_states.dtype
        if self._grouped(hidden_states.device):
            return grouped_experts_forward(self, x, top_k_index, top_k_weights, out_dtype=dtype)
        return self.forward_per_expert(x, top_k_index, top_k_weights, out_dtype=dtype)

    def forward_per_expert(self, hidden_states, top_k_index, top_k_weights, out_dtype=None):
        out = torch.zeros_like(hidden_states, dtype=out_dtype)
        for e, top_k_pos, token_idx in _route(self.num_experts, top_k_index):
            gate_up = self._linear(hidden_states[token_idx], "gate_up_proj", e)
            h = self._linear(self.activation(gate_up), "down_proj", e)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        e, two_i, h = full_shape(self.gate_up_proj)
        return f"num_experts={e}, hidden={h}, intermediate={two_i // 2}, fp8=e4m3 w128x128/x1x128"


class _W8A8Expert(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, device, pow2_scales: bool):
        super().__init__()
        kwargs = dict(dtype=dtype, device=device, pow2_scales=pow2_scales)
        self.gate_proj = W8A8Linear(hidden, intermediate, False, **kwargs)
        self.up_proj = W8A8Linear(hidden, intermediate, False, **kwargs)
        self.down_proj = W8A8Linear(intermediate, hidden, False, **kwargs)


class W8A8Experts(ExpertsGate, nn.ModuleList):
    """Sampler-side experts in vLLM's per-expert checkpoint names (`experts.{e}.gate_proj.weight`, ...)."""

    def __init__(self, experts: nn.Module, dtype: torch.dtype, *, pow2_scales: bool = False):
        e, two_i, h = experts.gate_up_proj.shape
        device = experts.gate_up_proj.device
        super().__init__([_W8A8Expert(h, two_i // 2, dtype, device, pow2_scales) for _ in range(e)])
        self.num_experts = e
        self.take_gate(experts)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, top_k_pos, token_idx in _route(self.num_experts, top_k_index):
            x = hidden_states[token_idx]
            expert = self[e]
            h = expert.down_proj(self.activation(torch.cat([expert.gate_proj(x), expert.up_proj(x)], dim=-1)))
            out.index_add_(0, token_idx, (h * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out


def expert_views(prefix: str, gate_up: torch.Tensor | None = None, down: torch.Tensor | None = None):
    """`(name, view)` of each expert's gate, up and down in fused `gate_up` (E, 2I, ...) and `down` (E, ...), named as
    checkpoints store experts (`{prefix}{e}.gate_proj`), either tensor alone if the other is `None`: gate is the
    first half of gate_up's rows, up the second. The same cut serves weights (E, 2I, H) and their 128x128 block
    scales (E, 2I/128, H/128)."""
    for e in range((gate_up if gate_up is not None else down).shape[0]):
        if gate_up is not None:
            half = gate_up.shape[1] // 2
            yield f"{prefix}{e}.gate_proj", gate_up[e, :half]
            yield f"{prefix}{e}.up_proj", gate_up[e, half:]
        if down is not None:
            yield f"{prefix}{e}.down_proj", down[e]


def iter_expert_pairs(prefix: str, gate_up: tuple, down: tuple):
    """Per-expert checkpoint pairs from fused quantizations `(q, scale_inv)` of gate_up (E, 2I, H) and down."""
    (qgu, sgu), (qd, sd) = gate_up, down
    for (name, q), (_, s) in zip(expert_views(prefix, qgu, qd), expert_views(prefix, sgu, sd), strict=True):
        yield f"{name}.weight", q
        yield f"{name}.weight_scale_inv", s


@contextmanager
def capture_routing(model: nn.Module):
    """Records the top-k expert indices every experts module of `model` receives, in call order (one entry per
    layer per forward): `with capture_routing(model) as routes: model(ids)`."""
    routes: list[torch.Tensor] = []
    handles = [
        m.register_forward_pre_hook(lambda _m, args: routes.append(args[1].detach().cpu()))
        for m in model.modules()
        if is_fused_experts(m) or isinstance(m, FP8Experts | W8A8Experts)
    ]
    try:
        yield routes
    finally:
        for h in handles:
            h.remove()
