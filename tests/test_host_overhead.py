"""(i) of `gpu_bench.py` (`benchmarks/host_overhead.py`): the null kernels, which stand in for the `torch` backend's
Triton quantizers and cuBLAS GEMM so that the host's time per FP8 linear can be measured on a CPU, must hand out the
very layouts the real kernels write: else `cublas_operands` would pad or copy where a GPU does not, and the figure
would time work that never happens. The Triton kernels run here on Triton's interpreter; the section itself runs in
`tests/test_examples.py::test_gpu_bench_smoke`."""

import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from trl_fp8.quant.backends import torch_scaled_mm
from trl_fp8.quant.backends._quantize import triton_status


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import host_overhead  # noqa: E402


needs_triton = pytest.mark.skipif(not triton_status()[0], reason=triton_status()[1])


def _layout(t):
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype)


@needs_triton
@pytest.mark.parametrize("m,k", [(1, 256), (130, 384), (256, 128)])
def test_null_kernels_have_the_layouts_of_the_triton_quantizers(m, k):
    from trl_fp8.quant.backends import triton_kernels

    x = torch.randn(m, k)
    for with_t in (True, False):
        real = triton_kernels.quantize_act(x, with_t=with_t)
        assert [_layout(t) for t in host_overhead._null_act(x, False, with_t)] == [_layout(t) for t in real]
        xs = [x, torch.randn(m, 128)]
        q, s, qts, sts = triton_kernels.quantize_act_columns(xs, with_t=with_t)
        nq, ns, nqts, nsts = host_overhead._null_act_columns(xs, False, with_t)
        assert (_layout(nq), _layout(ns)) == (_layout(q), _layout(s))
        assert [_layout(t) for t in nqts + nsts] == [_layout(t) for t in qts + sts]
    w = torch.randn(k, 256)  # the weight path: (N, K) in whole 128-blocks, as FP8Linear's stacked siblings have it
    real = triton_kernels.quantize_weight(w, with_t=True)
    assert [_layout(t) for t in host_overhead._null_weight(w, (128, 128), False, "w", False, True)] == [
        _layout(t) for t in real
    ]
    ws = [torch.randn(256, k), torch.randn(128, k)]  # stacked q/k/v's weights, each member whole 128-row blocks
    real = triton_kernels.quantize_weight_rows(ws, with_t=True)
    assert [_layout(t) for t in host_overhead._null_weight_rows(ws, False, True)] == [_layout(t) for t in real]


def test_null_kernels_run_fp8_linears_without_a_copy_or_a_pad():
    """What the null kernels time is trl-fp8's Python, autograd and `cublas_operands` on the no-copy path a GPU takes:
    no aten op of theirs copies or pads, for a linear alone and for stacked q/k/v, forward and backward. (With K a
    multiple of 512, as every Llama's: cuBLAS wants the 128x128 scales' K blocks padded to a multiple of 4, a pad of
    a few bytes that a GPU makes too.)"""
    x = torch.randn(130, 512, requires_grad=True)
    with host_overhead.null_kernels() as null:
        linear = host_overhead._fp8(nn.Linear(512, 1024, bias=False), "torch", null)
        qkv = host_overhead._fp8(host_overhead.QKV(512, 512, torch.float32, "cpu"), "torch", null)
        assert qkv.q_proj._siblings is not None  # the group runs, not three linears
        for module in (linear, qkv):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                outs = module(x)
                outs = outs if isinstance(outs, tuple) else (outs,)
                torch.autograd.backward(outs, [torch.ones_like(y) for y in outs])
            names = {e.name for e in prof.events()}
            assert not names & {"aten::copy_", "aten::clone", "aten::constant_pad_nd", "aten::cat"}, names
            assert module.weight.grad is not None if module is linear else qkv.k_proj.weight.grad is not None
    assert x.grad is not None


def test_host_figures_are_per_call_and_compared_with_the_right_baseline():
    host = host_overhead.bench_host(torch.device("cpu"), {}, iters=5)
    assert list(host) == ["shape", "nn.Linear, CPU, tiny", "null kernels", "per_call_us"]
    for key in ("linear", "qkv"):
        assert host["nn.Linear, CPU, tiny"][key + "_us"] > 0
        null = host["null kernels"]
        assert null[key + "_extra_us"] == pytest.approx(null[key + "_us"] - host["nn.Linear, CPU, tiny"][key + "_us"])
    # A CPU has no FP8 kernels to launch: the per-call table holds the baselines only, and says so in its rows.
    assert list(host["per_call_us"]) == ["aten add (one small kernel)", "mm, high precision"]
    md = "\n".join(host_overhead.host_markdown(host))
    assert "| one linear |" in md and "| q/k/v (FP8: stacked) |" in md
    assert "| mm, high precision | " in md and "per_call_us" not in md


def test_enqueue_time_is_microseconds_per_call_of_the_best_repeat():
    calls, delays = [], iter([0.004] * 3 + [0.004] * 4 + [0.002] * 4 + [0.004] * 4)

    def fn():
        calls.append(1)
        time.sleep(next(delays))

    us = host_overhead.enqueue_us(fn, torch.device("cpu"), iters=4, repeats=3)
    assert len(calls) == 3 + 4 * 3  # three warm-up calls, then `repeats` runs of `iters`
    assert 2000 <= us < 3500  # the fastest run's 2 ms per call, in microseconds


@needs_triton
def test_launch_ops_make_the_calls_of_an_fp8_linear():
    """Each call (i) times per launch runs the kernel it names on operands of the right layout: the FP8 GEMM's
    result is X Wᵀ to FP8's error. The cuBLAS calls need an SM90 GPU; the rest run on Triton's interpreter."""
    from trl_fp8.quant.backends import BACKENDS

    torch.manual_seed(0)
    ops = host_overhead.launch_ops(
        torch.device("cpu"), {"torch": torch_scaled_mm, "triton": BACKENDS["triton"]}, 8, 256
    )
    assert list(ops) == [
        "aten add (one small kernel)",
        "mm, high precision",
        "Triton quantize X + Xᵀ, autotuned",
        "Triton quantize X + Xᵀ, one config",
        "Triton quantize W + Wᵀ, autotuned",
        "F.scaled_mm blockwise (cuBLASLt)",
        "torch backend gemm (+ cublas_operands)",
        "triton backend gemm (autotuned)",
    ]
    reference = ops["mm, high precision"]()
    q, s, qt, st = ops["Triton quantize X + Xᵀ, one config"]()
    assert [_layout(t) for t in (q, s, qt, st)] == [_layout(t) for t in ops["Triton quantize X + Xᵀ, autotuned"]()]
    assert qt is not None and ops["Triton quantize W + Wᵀ, autotuned"]()[2].shape == (256, 256)
    out = ops["triton backend gemm (autotuned)"]().float()
    sqnr = 10 * torch.log10(reference.pow(2).mean() / (out - reference).pow(2).mean())
    # Gaussian X and W in e4m3 blocks give 20.5-20.7 dB against the exact product here (the emulated oracle's GEMM
    # of the same codes as much, to 0.03 dB); a wrong scale layout or operand order gives noise, below 0 dB.
    assert out.shape == reference.shape and sqnr > 18, sqnr
