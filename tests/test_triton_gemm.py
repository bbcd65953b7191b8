"""The block-scaled Triton GEMM against the `emulated` oracle, and `FP8Linear` on the Triton backend (all three GEMMs,
NaNs in training, a non-finite weight at export).

As in tests/test_triton_kernels.py, the kernels are compiled on a GPU and run in Triton's CPU interpreter without
one. Outputs must match the oracle up to the fp32 accumulation order (`ACCUMULATION_DB`; on E4M3-grid inputs every
quantization is exact, so that is the only difference), and bf16 outputs to 45 dB. The interpreter rounds to E4M3
and bf16 its own way, so the bf16 and NaN cases run on a GPU only."""

import copy
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import ACCUMULATION_DB, TMA_FAILS_ON_GPU, on_grid, sqnr_db, triton_marks
from torch import nn

from trl_fp8.quant import FP8Linear, quantize_blockwise
from trl_fp8.quant.backends import emulated, resolve_backend


pytestmark = triton_marks()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT_ROUNDING = DEVICE == "cuda"


def test_nonfinite_weight_is_refused_at_the_latest_by_the_next_export():
    """A forward defers the weight's NaN check (no host sync per layer, on every backend); `quantized_weight()`,
    which every sampler sync calls, then raises naming the layer, though the weight's quantization is cached.
    `tests/test_linear.py` holds the emulated backend to the same."""
    module, _ = _linear_pair(torch.randn(256, 256), torch.zeros(256), pow2=False)
    module.fp8_name = "model.layers.1.mlp.up_proj.weight"
    with torch.no_grad():
        module.weight[7, 7] = float("nan")
    y = module(torch.randn(3, 256, device=DEVICE))  # no raise
    if EXACT_ROUNDING:  # the interpreter's GEMM reads E4M3's NaN code as 480
        assert y.isnan().any()
    for _ in range(2):  # the check is not spent by the first refusal
        with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight.*1 NaN"):
            module.quantized_weight()


# 64-wide tiles share one weight scale per K block (a scalar in the kernel), 256-wide tiles span two (a vector); the
# TMA tile reads A and B by tensor descriptors (zero-filled beyond M, N and K), warp-specialized on a GPU.
TILES = {
    "default": None,
    "wide": {"BLOCK_M": 64, "BLOCK_N": 256, "GROUP_M": 4},
    "tma": {"BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 4, "TMA": True},
}


GPU_TILES = {"wide": dict(num_warps=8, num_stages=3), "tma": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3)}


@pytest.mark.parametrize("tile", ["default", "wide", pytest.param("tma", marks=TMA_FAILS_ON_GPU)])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("transposed_b", [False, True])
def test_triton_gemm_matches_emulated(b_block, transposed_b, tile, monkeypatch):
    from trl_fp8.quant.backends.triton_gemm_kernels import gemm

    if tile == "tma":
        monkeypatch.setenv("TRL_FP8_TRITON_TMA", "1")
    tile = TILES[tile] and {**TILES[tile], **(GPU_TILES[tile] if torch.cuda.is_available() else {})}

    torch.manual_seed(0)
    a, sa = quantize_blockwise(torch.randn(200, 300, device=DEVICE), (1, 128))
    if transposed_b:  # dgrad's operand: a transposed view of a (K, N) weight
        bt, sbt = quantize_blockwise(torch.randn(300, 136, device=DEVICE), b_block[::-1])
        b, sb = bt.t(), sbt.t()
    else:
        b, sb = quantize_blockwise(torch.randn(136, 300, device=DEVICE), b_block)
    out = gemm(a, sa, b, sb, b_block, torch.float32, config=tile)
    ref = emulated.gemm(a, sa, b, sb, b_block, torch.float32)
    assert out.shape == (200, 136)
    assert sqnr_db(ref, out) > ACCUMULATION_DB


_FAR_STORE = """
import sys, torch, triton
from trl_fp8.quant import quantize_blockwise
from trl_fp8.quant.backends.triton_gemm_kernels import _shape_bucket, gemm, gemm_kernel

device, (m, n, k) = sys.argv[1], (130, 128, 128)
torch.manual_seed(0)
a, sa = quantize_blockwise(torch.randn(m, k, device=device), (1, 128))
b, sb = quantize_blockwise(torch.randn(n, k, device=device), (128, 128))
# Rows 2**24 elements apart: rows 128 and 129 land past 2**31, as an (M, N) output with M * N > 2**31 would; 4 GiB
# of address space, of which only the rows written are ever touched.
c = torch.empty(2**24 * (m - 1) + n, dtype=torch.bfloat16, device=device).as_strided((m, n), (2**24, 1))
config = dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=4, TMA=False)
args = (a, b, c, sa, sb, m, n, k, *a.stride(), *b.stride(), *c.stride(), *sa.stride(), *sb.stride(),
        _shape_bucket(m, n, k), 0)
gemm_kernel[(triton.cdiv(m, 64) * triton.cdiv(n, 64),)](*args, B_ROWS_PER_SCALE=128, BLOCK_K=128, **config)
assert torch.equal(c, gemm(a, sa, b, sb, (128, 128), torch.bfloat16, config=config)), "rows differ"
"""


def test_triton_gemm_stores_past_2_31_elements():
    """The output offset is int64: with int32, rows past 2**31 elements (M * N > 2**31, e.g. 64k tokens through a 70B
    model's stacked gate/up) wrapped around to negative offsets, which crashed the interpreter (segfault) and would
    write outside the output on a GPU. A subprocess, so that such a crash fails this test alone."""
    run = subprocess.run([sys.executable, "-c", _FAR_STORE, DEVICE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"


def test_triton_gemm_keeps_tma_to_operands_it_can_read(monkeypatch):
    """TMA reads rows at 16-byte aligned addresses: the autotuner drops the TMA configs for operands whose rows are
    not (K = 300 bytes apart here), and asking for one anyway is an error that says why. (In the interpreter the
    autotuner runs the first config left: the other tests run the tuned path that way.)"""
    from trl_fp8.quant.backends.triton_gemm_kernels import _prune_configs, _tma_ok, configs, gemm

    a = torch.zeros(200, 300, dtype=torch.float8_e4m3fn, device=DEVICE)
    b = torch.zeros(136, 300, dtype=torch.float8_e4m3fn, device=DEVICE)
    a_s, b_s = torch.ones(200, 3, device=DEVICE), torch.ones(2, 3, device=DEVICE)
    aligned = torch.zeros(200, 304, dtype=torch.float8_e4m3fn, device=DEVICE)
    monkeypatch.setenv("TRL_FP8_TRITON_TMA", "1")  # on a GPU the TMA configs run only when asked
    assert not _tma_ok(a, b) and _tma_ok(aligned, aligned[:136])
    assert not _tma_ok(aligned[:, 1:], aligned[:136, 1:])  # rows aligned, base address not
    monkeypatch.setenv("TRL_FP8_TRITON_TMA", "0")
    assert not _tma_ok(aligned, aligned[:136])
    monkeypatch.delenv("TRL_FP8_TRITON_TMA")
    assert _tma_ok(aligned, aligned[:136]) == (DEVICE == "cpu")  # unset: on in the interpreter, off on a GPU
    assert any(c.kwargs["TMA"] for c in configs)
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert _prune_configs(configs, {"TMA_OK": 1}) == configs[:1]
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the pruning a GPU sees
    assert _prune_configs(configs, {"TMA_OK": 0}) == [c for c in configs if not c.kwargs["TMA"]]
    assert _prune_configs(configs, {"TMA_OK": 1}) == configs
    monkeypatch.undo()
    monkeypatch.setenv("TRL_FP8_TRITON_TMA", "1")
    with pytest.raises(ValueError, match=r"TMA cannot read these operands.*\(300, 1\)"):
        gemm(a, a_s, b, b_s, (128, 128), torch.float32, config=TILES["tma"])
    monkeypatch.setenv("TRL_FP8_TRITON_TMA", "0")  # readable operands, but the switch is off: the error says that
    with pytest.raises(ValueError, match=r"TMA configs are off \(TRL_FP8_TRITON_TMA=0; on a GPU they run only with 1"):
        gemm(aligned, a_s, aligned[:136], b_s, (128, 128), torch.float32, config=TILES["tma"])


def _linear_pair(weight: torch.Tensor, bias: torch.Tensor, pow2: bool) -> tuple[FP8Linear, FP8Linear]:
    lin = nn.Linear(weight.shape[1], weight.shape[0], device=DEVICE, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        lin.bias.copy_(bias)
    fast = FP8Linear.from_linear(copy.deepcopy(lin), backend="triton", pow2_scales=pow2)
    slow = FP8Linear.from_linear(copy.deepcopy(lin), backend="emulated", pow2_scales=pow2)
    assert fast._backend_for(torch.device(DEVICE)) is resolve_backend("triton", torch.device(DEVICE))
    return fast, slow


def _fprop_dgrad_wgrad(module: FP8Linear, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_()
    y = module(x)
    (y * dy).sum().backward()  # dy is exactly the output gradient
    return y, x.grad, module.weight.grad, module.bias.grad


def test_fp8_linear_on_triton_backend_matches_emulated_exactly_on_grid_inputs():
    """fp32 data whose every quantization is exact: both paths use the same FP8 codes in all three GEMMs, so they
    differ only in how the GEMMs accumulate, on the GPU and in the interpreter alike."""
    fast, slow = _linear_pair(on_grid(256, 300, seed=2).to(DEVICE), torch.randn(256).to(DEVICE), pow2=True)
    x = on_grid(200, 300, seed=3).to(DEVICE).reshape(4, 50, 300)
    dy = on_grid(200, 256, seed=4).to(DEVICE).reshape(4, 50, 256)
    for got, ref, what in zip(
        _fprop_dgrad_wgrad(fast, x, dy), _fprop_dgrad_wgrad(slow, x, dy), ("y", "dx", "dw", "db"), strict=True
    ):
        assert sqnr_db(ref, got) > ACCUMULATION_DB, what


@pytest.mark.skipif(not EXACT_ROUNDING, reason="the interpreter rounds to E4M3 and BF16 differently from hardware")
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_linear_on_triton_backend_matches_emulated_in_bf16(pow2):
    torch.manual_seed(0)
    fast, slow = _linear_pair(torch.randn(384, 512) * 0.02, torch.randn(384), pow2)
    x = torch.randn(2, 300, 512, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(2, 300, 384, device=DEVICE, dtype=torch.bfloat16)
    fast, slow = fast.to(DEVICE, torch.bfloat16), slow.to(DEVICE, torch.bfloat16)
    # Same codes, another summation order; the outputs are rounded to bf16 (8 bits: ~52 dB).
    for got, ref, what in zip(
        _fprop_dgrad_wgrad(fast, x, dy), _fprop_dgrad_wgrad(slow, x, dy), ("y", "dx", "dw", "db"), strict=True
    ):
        assert sqnr_db(ref, got) > 45, what


@pytest.mark.skipif(not EXACT_ROUNDING, reason="the interpreter's GEMM reads E4M3's NaN code as 480")
def test_a_nan_in_training_shows_in_the_outputs_and_gradients_as_in_the_oracle():
    """A token whose activation is NaN (an overflow upstream) turns its output row NaN, and a NaN output gradient
    turns dX and dW NaN, on the fast path as on `emulated`: a diverging run shows a NaN loss, not finite garbage."""
    torch.manual_seed(0)
    fast, slow = _linear_pair(torch.randn(256, 384) * 0.02, torch.randn(256), pow2=False)
    x = torch.randn(2, 70, 384, device=DEVICE)
    x[1, 9, 17] = float("nan")
    dy = torch.randn(2, 70, 256, device=DEVICE)
    dy[0, 3, 250] = float("nan")
    got, ref = _fprop_dgrad_wgrad(fast, x, dy), _fprop_dgrad_wgrad(slow, x, dy)
    for g, r, what in zip(got, ref, ("y", "dx", "dw", "db"), strict=True):
        assert g.isnan().any() and torch.equal(g.isnan(), r.isnan()), what
    assert got[0].isnan().sum() == 256 and got[0][1, 9].isnan().all()  # that token's row, and only it


def test_gpu_bench_reads_the_gemm_autotuner_it_records():
    """`gpu_bench` records what the Triton GEMM's autotuner timed, on a GPU only: without one the interpreter's
    autotuner (one config, untimed) stands in, so that the recording runs against Triton's real `Autotuner` before a
    GPU does."""
    import sys
    from pathlib import Path

    from trl_fp8.quant.backends.triton_gemm_kernels import gemm

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpu_bench import _autotuning

    a, sa = quantize_blockwise(torch.randn(72, 640, device=DEVICE), (1, 128))  # a shape bucket no other test tunes
    b, sb = quantize_blockwise(torch.randn(136, 640, device=DEVICE), (128, 128))
    out = {}
    with _autotuning("triton", torch.device("cuda"), out, "128x128"):
        gemm(a, sa, b, sb, (128, 128), torch.float32)
    with _autotuning("triton", torch.device("cuda"), out, "again"):
        gemm(a, sa, b, sb, (128, 128), torch.float32)  # tuned already: nothing new to record
    assert "again" not in out
    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter keeps one (plain) config: triton 3.9 does not time it, older versions time it at 0.
        assert set(out["128x128"]) <= {"plain"} and all(v == 0.0 for v in out["128x128"].values())
    else:  # K = 640 bytes a row: TMA can read both operands, so where switched on the best of each kind was timed
        kinds = {"plain", "tma"} if os.environ.get("TRL_FP8_TRITON_TMA") == "1" else {"plain"}
        assert set(out["128x128"]) == kinds and all(0 < v < math.inf for v in out["128x128"].values())
