"""(i) of `gpu_bench.py`: the host's time per linear, forward + backward, where the GPU waits on it.

At 1 x 4096 tokens the 1B training step ran at 0.58x BF16 on an H200 (RESULTS, 2026-12-04) while its 4 x 4096 step
was at parity: some 80 ms per step that do not scale with tokens. The 4 x 4096 step's trace puts 0.4-0.9 ms of host
time in each FP8 linear's forward and backward (Triton launches, cuBLAS's blockwise `_scaled_mm_v2`, trl-fp8's own
Python), against a GPU that then had queued work to hide it. This times that host cost per call, at a token count
small enough that the kernels take microseconds:

- `nn.Linear`, `FP8Linear` and a stacked q/k/v group (`FP8SiblingGroup`) on each real backend (on a GPU);
- the same FP8 modules with **null kernels**: the `torch` backend with its Triton quantizers and `F.scaled_mm`
  replaced by allocations of their outputs' exact layouts, on the CPU. What remains is trl-fp8's own Python,
  `cublas_operands` and autograd: the share this repository controls, measurable on any machine;
- each call a linear is made of, alone (`launch_ops`): Triton's quantizer launches with and without the autotuner,
  cuBLASLt's blockwise `F.scaled_mm`, the backends' `gemm`, against an aten op's and BF16's GEMM's launch.

    python benchmarks/host_overhead.py            # null kernels on this machine's CPU (and real ones on a GPU)
"""

import contextlib
import time
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from trl_fp8.quant import FP8Linear
from trl_fp8.quant.backends import BACKENDS, torch_scaled_mm
from trl_fp8.quant.linear import _SharedActivation
from trl_fp8.quant.siblings import group_siblings


# Llama-3.2-1B's q/k/v (hidden 2048, 32 heads, 8 KV heads of 64) at a token count where kernels are microseconds.
HIDDEN, KV, TOKENS = 2048, 512, 64


def _act_layout(m: int, k: int, device):
    m_q, m_t, kb, mb = -(-m // 4) * 4, -(-m // 128) * 128, -(-k // 128), -(-m // 128)
    q = torch.empty((m_q, k), dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty_strided((m_q, kb), (1, m_q), dtype=torch.float32, device=device)
    qt = torch.empty((k, m_t), dtype=torch.float8_e4m3fn, device=device)
    st = torch.empty_strided((k, mb), (1, k), dtype=torch.float32, device=device)
    return q, s, qt, st


def _null_act(x2d, pow2_scales, with_t):
    q, s, qt, st = _act_layout(*x2d.shape, x2d.device)
    return (q, s, qt, st) if with_t else (q, s, None, None)


def _null_act_columns(x2ds, pow2_scales, with_t):
    m, widths = x2ds[0].shape[0], [x.shape[1] for x in x2ds]
    q, s, _, _ = _act_layout(m, sum(widths), x2ds[0].device)
    ts = [_act_layout(m, w, x2ds[0].device)[2:] if with_t else (None, None) for w in widths]
    return q, s, [t[0] for t in ts], [t[1] for t in ts]


def _weight_layout(n: int, k: int, device):
    # Wᵀ as the GPU path gets it (contiguous, from the kernel), whatever the CPU path asks: else `cublas_operands`
    # would time a copy that a GPU never makes.
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty((n // 128, k // 128), device=device)
    qt, st = torch.empty((k, n), dtype=torch.float8_e4m3fn, device=device), torch.empty(s.shape[::-1], device=device)
    return q, s, qt, st, torch.zeros(s.shape, device=device)


def _null_weight(w, block, pow2_scales, name, check_finite=True, with_t=False):
    q, s, qt, st, amax = _weight_layout(*w.shape, w.device)
    return q, s, qt, st, None if check_finite else amax


def _null_weight_rows(ws, pow2_scales, with_t):
    return _weight_layout(sum(w.shape[0] for w in ws), ws[0].shape[1], ws[0].device)


def _null_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16, **_):
    return torch.empty((mat_a.shape[0], mat_b.shape[1]), dtype=output_dtype, device=mat_a.device)


@contextlib.contextmanager
def null_kernels():
    """The `torch` backend with every kernel a mere allocation of its output, runnable on the CPU."""
    patches = [
        mock.patch.object(torch_scaled_mm, "quantize_act", _null_act),
        mock.patch.object(torch_scaled_mm, "quantize_act_columns", _null_act_columns),
        mock.patch.object(torch_scaled_mm, "quantize_weight", _null_weight),
        mock.patch.object(torch_scaled_mm, "quantize_weight_rows", _null_weight_rows),
        mock.patch.object(F, "scaled_mm", _null_scaled_mm),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield torch_scaled_mm


class QKV(nn.Module):
    def __init__(self, hidden: int, kv: int, dtype, device):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, n, **kw) for n in (hidden, kv, kv))

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _fp8(module: nn.Module, backend: str, backend_module=None) -> nn.Module:
    """`module` with its linears as FP8Linear on `backend` (q/k/v stacked, as conversion stacks them); a given
    `backend_module` is put in place of what `backend` resolves to (the null kernels)."""
    for name, child in list(module.named_children()) or [("", module)]:
        if not isinstance(child, nn.Linear):
            continue
        fp8 = FP8Linear.from_linear(child, backend=backend, name=name or "linear")
        if backend_module is not None:
            fp8._backends[child.weight.device] = backend_module
        if name:
            setattr(module, name, fp8)
        else:
            module = fp8
    group_siblings(module)
    return module


def host_us(module: nn.Module, x: torch.Tensor, iters: int, repeats: int = 5) -> float:
    """Microseconds per forward + backward, the best of `repeats` runs of `iters` calls (on a GPU, timed to the
    last kernel's end: with microsecond kernels that is the host's time). Gradients are dropped before each call, so
    that none is summed into the last (a CPU-bound addition the null kernels would otherwise time)."""
    outs = module(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.ones_like(y) for y in outs]
    params = [x, *module.parameters()]

    def call():
        for p in params:
            p.grad = None
        # A new batch's X, as in training: else the shared quantization of the last X answers and the forward's
        # activation quantizer, whose launch this measures, never runs (the weight's stays cached, as within a step).
        _SharedActivation.entry = None
        ys = module(x)
        torch.autograd.backward(ys if isinstance(ys, tuple) else (ys,), grads)

    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(repeats):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        if x.is_cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def enqueue_us(fn, device: torch.device, iters: int, repeats: int = 5) -> float:
    """Host microseconds per call of `fn`, timed from an idle device to the last call's return without waiting for
    the kernels: with kernels of microseconds and fewer launches than a GPU's queue holds (about a thousand), that is
    the launch path's own cost (Python, the launcher, the library's host work), whatever the kernels take."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    sync()
    return best


def launch_ops(device: torch.device, backends: dict, tokens: int = TOKENS, hidden: int = HIDDEN) -> dict:
    """The calls one FP8 linear's forward + backward is made of, X (tokens, hidden) and W (hidden, hidden), each
    alone: a one-kernel aten op and the high-precision GEMM (BF16 cuBLAS on a GPU) as the baselines; on the `torch`
    backend its Triton quantizers (through the autotuner, and with one config given, which skips it),
    `F.scaled_mm`'s blockwise cuBLASLt call on ready operands, and the backend's `gemm` (the same call plus
    `cublas_operands`); on `triton` its GEMM."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, hidden, device=device, dtype=dtype)
    ops = {"aten add (one small kernel)": lambda: x.add(1.0), "mm, high precision": lambda: torch.mm(x, w.t())}
    fp8 = {name: module for name, module in backends.items() if name in ("torch", "triton")}
    if not fp8:
        return ops
    from trl_fp8.quant.backends import triton_kernels

    q, s, _, _ = triton_kernels.quantize_act(x, with_t=False)
    wq, ws, _, _, _ = triton_kernels.quantize_weight(w)
    if "torch" in fp8:
        operands = torch_scaled_mm.cublas_operands(q, s, wq, ws, (128, 128))
        ops["Triton quantize X + Xᵀ, autotuned"] = lambda: triton_kernels.quantize_act(x)
        ops["Triton quantize X + Xᵀ, one config"] = lambda: triton_kernels.quantize_act(x, config=dict(CHUNK=32))
        ops["Triton quantize W + Wᵀ, autotuned"] = lambda: triton_kernels.quantize_weight(w, with_t=True)
        ops["F.scaled_mm blockwise (cuBLASLt)"] = lambda: F.scaled_mm(*operands, output_dtype=torch.bfloat16)
        ops["torch backend gemm (+ cublas_operands)"] = lambda: torch_scaled_mm.gemm(
            q, s, wq, ws, (128, 128), torch.bfloat16
        )
    if "triton" in fp8:
        ops["triton backend gemm (autotuned)"] = lambda: fp8["triton"].gemm(q, s, wq, ws, (128, 128), torch.bfloat16)
    return ops


def bench_launches(device: torch.device, backends: dict, iters: int = 200) -> dict:
    """Host microseconds per call of each of `launch_ops`, as enqueued (`enqueue_us`): where (i)'s FP8 extra per
    linear goes, between Triton's launcher, its autotuner, cuBLASLt's blockwise GEMM and trl-fp8's operand code."""
    torch.manual_seed(0)
    # On a CPU only the baselines run (there are no FP8 kernels to launch), at the tiny nn.Linear's shape.
    ops = launch_ops(device, backends) if device.type == "cuda" else launch_ops(device, {}, 4, 128)
    return {name: enqueue_us(fn, device, iters) for name, fn in ops.items()}


def bench_host(device: torch.device, backends: dict, iters: int = 200) -> dict:
    """Host microseconds per forward + backward of one linear (K = N = 2048) and of a stacked q/k/v group, each at
    64 tokens: on a GPU BF16 vs every backend in `backends`; everywhere the null kernels, on the CPU."""
    torch.manual_seed(0)
    out = dict(
        shape=f"{TOKENS} tokens, linear {HIDDEN}x{HIDDEN}, q/k/v {HIDDEN} -> {HIDDEN}+{KV}+{KV} (but where noted)"
    )
    runs = [("bf16", device, None), *((name, device, None) for name in backends)] if device.type == "cuda" else []
    runs += [("nn.Linear, CPU, tiny", "cpu", None), ("null kernels", "cpu", "torch")]
    for label, dev, backend in runs:
        dev = torch.device(dev)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        # The CPU's nn.Linear at 4 tokens and 128 features, whose kernels take a few microseconds: the host cost of
        # a linear under autograd, against which the null kernels' row shows what trl-fp8's own Python adds.
        tokens, hidden, kv = (4, 128, 128) if label == "nn.Linear, CPU, tiny" else (TOKENS, HIDDEN, KV)
        x = torch.randn(tokens, hidden, device=dev, dtype=dtype, requires_grad=True)
        linear = nn.Linear(hidden, hidden, bias=False, device=dev, dtype=dtype)
        qkv = QKV(hidden, kv, dtype, dev)
        with null_kernels() if label == "null kernels" else contextlib.nullcontext() as null:
            if backend is not None or label in backends:
                linear, qkv = _fp8(linear, backend or label, null), _fp8(qkv, backend or label, null)
            out[label] = dict(linear_us=host_us(linear, x, iters), qkv_us=host_us(qkv, x, iters))
    for label, base in [*((name, "bf16") for name in backends), ("null kernels", "nn.Linear, CPU, tiny")]:
        for key in ("linear_us", "qkv_us"):
            out[label][key.replace("_us", "_extra_us")] = out[label][key] - out[base][key]
    out["per_call_us"] = bench_launches(device, backends, iters)
    return out


def host_markdown(host: dict) -> list[str]:
    labels = [k for k in host if k not in ("shape", "per_call_us")]
    note = "in brackets, more than BF16 on the same device; for the null kernels, more than the CPU's tiny nn.Linear"
    lines = ["", f"(i) host time per forward + backward, {host.get('shape', '')}: microseconds ({note})", ""]
    lines += ["| | " + " | ".join(labels) + " |", "|---" * (1 + len(labels)) + "|"]
    for key, name in (("linear", "one linear"), ("qkv", "q/k/v (FP8: stacked)")):
        cells = []
        for k in labels:
            extra = host[k].get(key + "_extra_us")
            cells.append(f"{host[k][key + '_us']:.0f}" + ("" if extra is None else f" ({extra:+.0f})"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if host.get("per_call_us"):
        lines += ["", "Host microseconds per call, each alone, enqueued without waiting for the kernels:", ""]
        lines += ["| call | µs |", "|---|---|"]
        lines += [f"| {name} | {us:.1f} |" for name, us in host["per_call_us"].items()]
    return lines


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = {n: m for n, m in BACKENDS.items() if n != "emulated" and m.is_available(device)[0]}
    print("\n".join(host_markdown(bench_host(device, backends))))
