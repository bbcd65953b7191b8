"""The Triton GEMM compiles for Hopper (SM90) on this CPU machine, and keeps what its code claims there: every
autotune config runs on FP8 tensor-core MMAs, spilling no more than a few registers, the TMA configs are
warp-specialized, and a tile within one 128x128 weight block scales each K block's products with one FFMA apiece.
`benchmarks/sm90_static.py` compiles it in a subprocess: the suite interprets the kernels (`TRITON_INTERPRET=1`), which
makes them Python functions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = [
    pytest.mark.skipif(
        not ((BIN / "ptxas").exists() and (BIN / "cuobjdump").exists()), reason="this triton ships no ptxas/cuobjdump"
    ),
    pytest.mark.xdist_group("sm90"),  # one compile (the module's fixture) for all its tests
]


@pytest.fixture(scope="module")
def sm90(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sm90") / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sm90_static.py"), "--json", str(out)]
    env["TRITON_CACHE_DIR"] = str(out.parent / "cache")  # compiled here, not read from an earlier run's cache
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| gemm 128x128, 8 warps" in result.stdout  # the markdown table
    return json.loads(out.read_text())["rows"]


def test_every_gemm_config_runs_fp8_mmas_without_spilling(sm90):
    from trl_fp8.quant.backends.triton_gemm_kernels import configs

    gemms = [r for r in sm90 if r["kernel"].startswith("gemm")]
    assert len(gemms) == 2 * len(configs)  # each config with 128x128 (fprop, dgrad) and 1x128 (wgrad) weight scales
    for r in gemms:
        assert r["QGMMA"] > 0, r  # Hopper's FP8 wgmma, not a fallback
        # No more than a few registers spilled, as the comment above `configs` says (triton 3.9: none; 3.6 spills
        # 16 bytes in the 128x128 wgrad config; the configs dropped spilled 224-280).
        assert r["stack_bytes"] <= 32, r
    # The TMA configs are warp-specialized as DeepGEMM is: TMA loads in a producer, two consumer warp groups.
    tma = [r for r in gemms if "TMA" in r["kernel"]]
    assert tma and all(r["warp_specialized"] and r["UTMALDG"] > 0 and r["num_warps"] == 12 for r in tma), tma
    assert not any(r["warp_specialized"] for r in gemms if r not in tma)
    # ... nor that the smaller tiles fit two CTAs per SM, for one's scaling to overlap the other's MMAs.
    small = [
        r for r in gemms if r["weight_scales"] == "128x128" and ("64x128" in r["kernel"] or "128x64" in r["kernel"])
    ]
    assert small and all(r["ctas_per_sm"] == 2 for r in small)


def test_one_ffma_per_product_within_one_weight_block(sm90):
    """Per K block each thread scales its share of the tile's products (BLOCK_M x BLOCK_N / threads): one FFMA each,
    by a per-row scale, where the tile lies within one 128x128 weight block; with 1x128 weight scales (or wider
    tiles) each product needs its own scale, one FMUL more. A warp-specialized kernel holds each consumer warp
    group's code once: two copies, each thread of the two groups (256) scaling its share."""
    for r in sm90:
        if not r["kernel"].startswith("gemm"):
            continue
        tile, warps = r["kernel"].split(", ")[:2]
        block_m, block_n = map(int, tile.removeprefix("gemm ").split("x"))
        copies, threads = (2, 256) if r["warp_specialized"] else (1, 32 * int(warps.split()[0]))
        per_thread = block_m * block_n // threads
        assert r["FFMA"] == copies * per_thread, r
        if r["weight_scales"] == "128x128" and block_n <= 128:
            assert r["FMUL"] <= 4 * copies, r  # a_s * b_s, once per row held
        else:
            assert r["FMUL"] == copies * per_thread, r


def test_the_moe_kernels_compile_to_fp8_mmas(sm90):
    """The grouped MoE kernels, written after the only GPU run so far, compile for SM90 at every autotune config: FP8
    wgmma, a few registers spilled at most, the expert GEMM's weight scale a scalar (one FFMA apiece), and the TMA
    configs warp-specialized (each consumer group's code once: twice the plain kernel's static counts)."""
    from trl_fp8.quant.backends.triton_gemm_kernels import grouped_configs

    grouped = [r for r in sm90 if r["kernel"].startswith("grouped")]
    assert {r["kernel"].split()[0] for r in grouped} == {"grouped_gemm_kernel", "grouped_wgrad_kernel"}
    assert len(grouped) == 2 * len(grouped_configs)
    for r in grouped:
        copies = 2 if r["warp_specialized"] else 1
        assert r["warp_specialized"] == ("TMA" in r["kernel"]) and (r["UTMALDG"] > 0) == ("TMA" in r["kernel"]), r
        assert r["QGMMA"] > 0 and r["stack_bytes"] <= 32 and r["FFMA"] == 64 * copies, r  # 128x128 tile, 256 threads
        if r["kernel"].startswith("grouped_gemm"):
            assert r["FMUL"] <= 4 * copies, r
        else:
            assert r["FMUL"] == 64 * copies, r


def test_every_quantizer_config_compiles_for_sm90(sm90):
    """The quantizers, walked in row slices: every autotune config compiles for SM90 without spills, with 16-byte
    vector loads of X or W."""
    from trl_fp8.quant.backends.triton_kernels import _QUANT_CONFIGS

    quantizers = [r for r in sm90 if r["kernel"].startswith("quantize")]
    assert len(quantizers) == 2 * len(_QUANT_CONFIGS)
    assert all(r["stack_bytes"] == 0 and r["LDG"] > 0 and r["LDG_128"] == r["LDG"] for r in quantizers), quantizers
    # A prefetching act quantizer has two slices' loads out before its first store, twice a plain one's, and loads
    # no more in all (the last slice's prefetch, past the tile, is dead code the compiler drops); running max (one
    # cross-row reduction, not one per slice) takes instructions away.
    act = {r["kernel"].removeprefix("quantize act, "): r for r in quantizers if r["kernel"].startswith("quantize act")}
    plain, prefetch = act["16-rows slices, 4 warps"], act["16-rows slices, 4 warps, prefetch"]
    assert prefetch["LDG_before_STG"] == 2 * plain["LDG_before_STG"] and prefetch["LDG"] == plain["LDG"]
    for rows in (32, 64):
        plain, both = act[f"{rows}-rows slices, 8 warps"], act[f"{rows}-rows slices, 8 warps, prefetch, running max"]
        assert both["LDG_before_STG"] == 2 * plain["LDG_before_STG"] and both["LDG"] == plain["LDG"], (plain, both)
        assert both["instructions"] < plain["instructions"], (plain, both)
    # Where one slice is the whole tile, pass 2 quantizes Xᵀ from pass 1's registers: X is read once, the tile's
    # bytes in 16-byte loads over the CTA's threads (a second read would double them).
    whole = act["128-rows slices, 8 warps"]
    assert whole["LDG"] == 128 * 128 * 2 // (16 * 8 * 32), whole
