"""Sibling linears, which read one input (attention's q/k/v, a gated MLP's gate/up), as one FP8 GEMM per pass.

transformers' Llama and Qwen keep q, k and v (gate and up) as separate linears; Megatron, where NeMo RL's FP8 figures
come from, fuses them (`linear_qkv`, `linear_fc1`), and TransformerEngine offers the same (`fuse_qkv_params`). One
GEMM over the stacked weights replaces three, each of whose small N (k and v have 1/4 to 1/8 of q's rows under GQA)
would run the tensor cores below their rate, and the backward quantizes the siblings' output gradients once and runs
one dgrad instead of three plus two additions. Conversion stacks q/k/v only; gate/up stack when asked
(`MLP_SIBLING_SETS`: why not by default there).

Nothing else changes: each sibling keeps its Parameters, name, `state_dict` key and optimizer state, and exports its
own rows of the stacked FP8 weight. Every sibling's rows are whole 128-row blocks (conversion requires it), so no
weight, activation or gradient block straddles two siblings and every quantization is the one each linear would
have made alone (the tests hold the two paths together). A sibling called with another input (or grad mode, or
version of it) than its siblings' pending outputs were computed for runs the stacked GEMM anew: any call order stays
correct, and causal LMs call q, k, v (gate, up) on one tensor in a row.

What does differ is summation order: the one dgrad sums the siblings' input gradients in fp32 and rounds once. In an
fp32 model gradients then agree with running each linear alone to > 50 dB; in a BF16 model, where each linear alone
rounds its dX to BF16 before autograd adds them, the ulp of difference moves later dY quantizations to neighbouring
E4M3 values and the two agree only at FP8's noise level, both equally close to fp32 gradients (tested).
"""

import copy
import itertools
import weakref

import torch

from .blockwise import _raise_nonfinite
from .linear import (
    FP8Linear,
    _SharedActivation,
    autocast_input,
    first_order_only,
    is_sharded,
    version_of,
)
from .staleness import serial, weights_epoch


# Stacked by conversion: q/k/v. Attention views their outputs as heads and transposes them (strided in BF16 too),
# and under GQA k and v alone are small GEMMs that run the tensor cores below their rate.
SIBLING_SETS = (("q_proj", "k_proj", "v_proj"),)
# Stacked only when asked (`group_siblings(model, SIBLING_SETS + MLP_SIBLING_SETS)`). Their outputs feed SiLU and a
# product, and these elementwise ops ran non-vectorized on column slices of one stacked output: 12.8 ms of a 342 ms
# Llama-3.2-1B step on an H200, against nothing to gain from stacking two equal, large GEMMs (benchmarks/RESULTS.md,
# 2026-12-04). Megatron's stacked `linear_fc1` pays off with its fused SwiGLU kernel, which HF models lack.
MLP_SIBLING_SETS = (("gate_proj", "up_proj"), ("w1", "w3"))


class _FP8SiblingsFunction(torch.autograd.Function):
    """Y = X · Wᵀ (+ b) for the siblings' stacked weights W = [W_1; ...; W_n] (M tokens, K in, N = Σ N_i out):

    - fprop: Y[M, N]       = X[M, K] · W[N, K]ᵀ        X in 1x128 blocks along K, W in 128x128 blocks
    - dgrad: dX[M, K]      = dY[M, N] · W[N, K]        dY (the siblings' output gradients side by side) in 1x128
      blocks along N, each quantized into its columns; W's FP8 bits and scales transposed, cached per step
    - wgrad: dW_i[N_i, K]  = dY_iᵀ[N_i, M] · X[M, K]   per sibling, on its dY_iᵀ (made with its columns of dY) and
      the shared Xᵀ, both in 1x128 blocks along M (fresh tensors: each Parameter's gradient is its own)

    Every GEMM accumulates in fp32; biases and their gradients stay in high precision.
    """

    @staticmethod
    def forward(ctx, x, group, wgrad, *params):
        n = len(group.members)
        weights, biases = params[:n], params[n:]
        backend = group.backend(x.device)
        x2d = x.reshape(-1, x.shape[-1])
        m = x2d.shape[0]
        want_t = wgrad and any(w.requires_grad for w in weights)
        x_fp8, x_s, xt_fp8, xt_s = _SharedActivation.quantize(backend, x, x2d, group.pow2_scales, want_t)
        w_fp8, w_s, w_fp8_t, w_s_t = group.quantized(check_finite=False)
        y = backend.gemm(x_fp8, x_s, w_fp8, w_s, (128, 128), x.dtype)[:m]
        if any(b is not None for b in biases):
            stacked = [b if b is not None else y.new_zeros(w.shape[0]) for b, w in zip(biases, weights, strict=True)]
            y = y + torch.cat(stacked).to(y.dtype)
        ctx.save_for_backward(w_fp8_t, w_s_t, xt_fp8, xt_s)
        ctx.group, ctx.backend, ctx.x_shape, ctx.x_dtype = group, backend, x.shape, x.dtype
        ctx.w_dtypes = [w.dtype for w in weights]
        ctx.has_bias = [b is not None for b in biases]
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        # One output per sibling, each its own tensor over its columns of Y (no copy): a model may modify one in
        # place (OLMo's clip_qkv clamps q, k and v in turn), which views of one Y forbid, and so do detached ones
        # (`as_output`): they share Y's version counter, so scaling q in place would void a k saved for backward.
        return tuple(_own_tensor(y[..., r0:r1]) for r0, r1 in group.rows)

    @staticmethod
    @first_order_only
    def backward(ctx, *dys):
        w_fp8_t, w_s_t, xt_fp8, xt_s = ctx.saved_tensors
        group, backend, n = ctx.group, ctx.backend, len(ctx.group.members)
        group.forget_outputs_of(ctx)  # this backward frees their graph: a sibling called later computes anew
        dy2ds = [dy.reshape(-1, dy.shape[-1]) for dy in dys]
        m = dy2ds[0].shape[0]
        needs_w = ctx.needs_input_grad[3 : 3 + n]
        # Each dY_i straight into its columns of the stacked FP8 dY: a `torch.cat` of the BF16 dYs first cost 5 ms of
        # a 342 ms step on an H200 (RESULTS 2026-12-04). Each member's dYᵢᵀ comes apart, in the layout wgrad reads.
        dy_fp8, dy_s, dyt_fp8s, dyt_ss = backend.quantize_act_columns(dy2ds, group.pow2_scales, any(needs_w))
        dx = None
        if ctx.needs_input_grad[0]:
            dx = backend.gemm(dy_fp8, dy_s, w_fp8_t, w_s_t, (128, 128), ctx.x_dtype)[:m].reshape(ctx.x_shape)
        dws, dbs = [None] * n, [None] * n
        for i in range(n):
            if needs_w[i]:
                dws[i] = backend.gemm(dyt_fp8s[i], dyt_ss[i], xt_fp8, xt_s, (1, 128), ctx.w_dtypes[i])
            if ctx.has_bias[i] and ctx.needs_input_grad[3 + n + i]:
                dbs[i] = dy2ds[i].sum(0)
        return dx, None, None, *dws, *dbs


@torch.compiler.disable  # dynamo cannot trace `set_`; the FP8 linears break the graph anyway (README)
def _own_tensor(v: torch.Tensor) -> torch.Tensor:
    """`v`'s memory as a tensor of its own, with its own version counter and no autograd view history, copying
    nothing."""
    out = torch.empty(0, dtype=v.dtype, device=v.device)
    return out.set_(v.untyped_storage(), v.storage_offset(), v.shape, v.stride())


class FP8SiblingGroup:
    """`FP8Linear`s that read one input, run as one GEMM per pass (see the module docstring). Each member holds the
    group (`FP8Linear._siblings`) and asks it for its output and its quantized weight."""

    def __init__(self, members: list[FP8Linear]):
        first = members[0]
        for m in members:
            if (m.in_features, m.pow2_scales, m.backend, m.weight_block_size) != (
                first.in_features,
                first.pow2_scales,
                first.backend,
                first.weight_block_size,
            ) or m.weight_block_size != (128, 128):
                raise ValueError(f"{m.fp8_name} cannot join {first.fp8_name}'s sibling group: its recipe differs")
            if m.out_features % 128:
                raise ValueError(f"{m.fp8_name} has {m.out_features} rows, not whole 128-row blocks")
        # Weak references: the members hold the group, and a cycle would keep a deleted model's GPU memory until
        # Python's cycle collector happens to run.
        self._refs = [weakref.ref(m) for m in members]
        ends = list(itertools.accumulate(m.out_features for m in members))
        self.rows = list(zip([0, *ends[:-1]], ends, strict=True))
        self._cache: tuple | None = None
        self._pending: tuple | None = None
        for i, m in enumerate(members):
            m._siblings, m._sibling_index = self, i

    @property
    def members(self) -> list[FP8Linear]:
        return [ref() for ref in self._refs]

    def member(self, i: int) -> FP8Linear | None:
        return self._refs[i]()

    # Copies start without caches or outputs waiting for a sibling, and group the copied members.
    def __deepcopy__(self, memo):
        new = copy.copy(self)
        memo[id(self)] = new
        new._cache = new._pending = None
        new._refs = [weakref.ref(copy.deepcopy(m, memo)) for m in self.members]
        return new

    def __getstate__(self):  # pickling (torch.save): members by strong reference, which pickle's memo resolves
        return {**self.__dict__, "_refs": self.members, "_cache": None, "_pending": None}

    def __setstate__(self, state):
        self.__dict__.update(state, _refs=[weakref.ref(m) for m in state["_refs"]])

    def drop_caches(self) -> None:
        """Forgets the stacked weight and the pending outputs (a member's `.to()`: see `FP8Linear._apply`)."""
        self._cache = self._pending = None

    @property
    def pow2_scales(self) -> bool:
        return self.members[0].pow2_scales

    def backend(self, device: torch.device):
        """The members' backend on `device`; refuses members whose settings were changed apart after grouping."""
        members = self.members
        settings = [(m.backend, m.weight_block_size, m.pow2_scales) for m in members]
        if len(set(settings)) > 1 or settings[0][1] != (128, 128):
            chosen = ", ".join(
                f"{m.fp8_name}: backend={b!r}, weight_block_size={k}, pow2_scales={p}"
                for m, (b, k, p) in zip(members, settings, strict=True)
            )
            raise ValueError(
                "stacked siblings run as one GEMM: give them one backend, one pow2_scales and 128x128 weight blocks "
                f"({chosen})"
            )
        return members[0]._backend_for(device)

    def _key(self) -> tuple:
        """What the stacked weight and pending outputs were made from: each member's weight (optimizer steps, tensor
        object, version, storage, device, dtype) and bias (tensor object, version, storage)."""
        key = []
        for m in self.members:
            w, b = m.weight, m.bias
            key.append(
                (serial(w), w._version, w.data_ptr(), w.device, w.dtype)
                + (() if b is None else (serial(b), b._version, b.data_ptr()))
            )
        return (weights_epoch(), self.pow2_scales, *key)

    def quantized(self, check_finite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacked `(weight_fp8, weight_scale_inv, weight_fp8ᵀ, weight_scale_invᵀ)`, quantized once per step,
        with `FP8Linear`'s deferred NaN/inf check."""
        entry = self._cache  # a hit, as FP8Linear's: no grad-mode switches
        if entry is not None and (not check_finite or entry[5] is None) and entry[0] == self._key():
            if not any(is_sharded(m.weight, m) for m in self.members):
                return entry[1:5]
        return self._quantize(check_finite)

    @torch.inference_mode(False)  # as FP8Linear's cache: autograd must be able to save it
    @torch.no_grad()
    def _quantize(self, check_finite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ws = [m.weight for m in self.members]
        key, sharded = self._key(), any(is_sharded(m.weight, m) for m in self.members)
        entry = self._cache
        if sharded or entry is None or entry[0] != key:
            backend = self.backend(ws[0].device)
            contiguous = ws[0].is_cuda and any(w.requires_grad for w in ws)
            # Each member into its rows of the stacked FP8 weight: no BF16 concatenation of q/k/v per step.
            entry = (key,) + backend.quantize_weight_rows([w.detach() for w in ws], self.pow2_scales, contiguous)
        if check_finite and entry[5] is not None:
            if not bool(torch.isfinite(entry[5]).all()):
                for m in self.members:  # name the culprit, not the stack
                    if not bool(torch.isfinite(m.weight).all()):
                        _raise_nonfinite(m.weight, m.fp8_name)
            entry = (*entry[:5], None)
        if not sharded:  # as FP8Linear's: no cache of a sharded weight
            self._cache = entry
        return entry[1:5]

    def member_weight(self, i: int, check_finite: bool) -> tuple[torch.Tensor, ...]:
        """Member `i`'s rows of `quantized()`: `(q, s, qᵀ, sᵀ)` views, the blocks it would have quantized alone."""
        q, s, qt, st = self.quantized(check_finite)
        (r0, r1), b0, b1 = self.rows[i], self.rows[i][0] // 128, self.rows[i][1] // 128
        return q[r0:r1], s[b0:b1], qt[:, r0:r1], st[:, b0:b1]

    def forward(self, member: FP8Linear, x: torch.Tensor) -> torch.Tensor:
        """`member(x)`: the stacked GEMM's output for it, computed with its siblings' on the first of their calls."""
        i, p = member._sibling_index, self._pending
        # Pending outputs fit only the very same input (and its version and requires_grad), grad and autocast mode
        # and parameters (an optimizer step in between, or an in-place write to a weight or bias, makes them stale).
        dev = x.device.type
        autocast = torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev)
        grad_mode = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), x.requires_grad, autocast)
        mode = (version_of(x), grad_mode, self._key())
        if p is not None and mode[0] is not None and p[0]() is x and p[1] == mode and i in p[2]:
            out = p[2].pop(i)
            if not p[2]:
                self._pending = None
            return out
        params = [m.weight for m in self.members] + [m.bias for m in self.members]
        # Pending outputs stay keyed on the caller's x: the autocast copy is new at every call.
        outs = _FP8SiblingsFunction.apply(autocast_input(x, member._where()), self, torch.is_grad_enabled(), *params)
        rest = {j: o for j, o in enumerate(outs) if j != i}
        # An inference tensor keeps no version to match by: its siblings recompute (rare: TRL's policy passes use
        # no_grad).
        self._pending = (weakref.ref(x, self._forget), mode, rest) if mode[0] is not None else None
        return outs[i]

    def forget_outputs_of(self, node) -> None:
        """Drops the pending outputs if autograd `node` made them (its backward is running)."""
        p = self._pending
        if p is not None and any(out.grad_fn is node for out in p[2].values()):
            self._pending = None

    def _forget(self, ref: weakref.ref) -> None:
        if self._pending is not None and self._pending[0] is ref:
            self._pending = None


def group_siblings(model: torch.nn.Module, sets: tuple[tuple[str, ...], ...] = SIBLING_SETS) -> list[FP8SiblingGroup]:
    """Groups the `FP8Linear` children of each module that form (part of) an entry of `sets` with one recipe;
    returns the new groups. Members already grouped are left alone."""
    groups = []
    for module in model.modules():
        for names in sets:
            members = [getattr(module, n, None) for n in names]
            members = [m for m in members if type(m) is FP8Linear and m._siblings is None]
            if len(members) < 2:
                continue
            first = members[0]
            same = [
                m
                for m in members
                if (m.in_features, m.pow2_scales, m.backend, m.weight_block_size, m.weight.device, m.weight.dtype)
                == (first.in_features, first.pow2_scales, first.backend, (128, 128), first.weight.device,
                    first.weight.dtype)
            ]  # fmt: skip
            if len(same) >= 2:
                groups.append(FP8SiblingGroup(same))
    return groups


def ungroup_siblings(model: torch.nn.Module) -> None:
    """Makes every grouped `FP8Linear` of `model` run alone again, each on its own weight."""
    for module in model.modules():
        if type(module) is FP8Linear:
            module._siblings, module._sibling_index = None, 0
