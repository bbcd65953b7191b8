"""What trl-fp8's Triton kernels compile to on Hopper, on any machine: no GPU is needed to compile for SM90 (Triton
ships `ptxas` and `cuobjdump`), only to run. Per kernel and autotune config: registers per thread, bytes of stack
(register spills), shared memory, and counts of SASS instructions (the FP8 MMAs, FFMA/FMUL, global loads, spill
traffic). The static half of a performance check, for the sessions that have no GPU to time the kernels on.

    python benchmarks/sm90_static.py                  # a markdown table of every config
    python benchmarks/sm90_static.py --json out.json  # and the figures as JSON
"""

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from trl_fp8.quant.backends import triton_gemm_kernels as tg
from trl_fp8.quant.backends import triton_kernels as tk


SM90 = GPUTarget("cuda", 90, 32)
SASS_OPS = ("QGMMA", "FFMA", "FMUL", "LDG", "STG", "LDGSTS", "UTMALDG", "STL", "LDL")
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

# Argument types and the specializations Triton's launcher makes at run time on the training path: unit strides as
# constants, 16-divisible pointers, sizes and strides (PyTorch's allocations and the multiples of 128 we quantize).
_GEMM = dict(
    types=dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", as_ptr="*fp32", bs_ptr="*fp32"),
    ints="M N K stride_am stride_ak stride_bn stride_bk stride_cm stride_cn stride_asm stride_ask stride_bsn "
    "stride_bsk SHAPE_BUCKET TMA_OK",
    divisible="a_ptr b_ptr c_ptr as_ptr bs_ptr M N K stride_am stride_bn stride_cm stride_ask",
)
_GROUPED = dict(
    types=dict(
        a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", as_ptr="*fp32", bs_ptr="*fp32", tile_expert_ptr="*i32"
    ),
    ints="M N K E stride_am stride_ak stride_be stride_bn stride_bk stride_cm stride_cn stride_asm stride_ask "
    "stride_bse stride_bsn stride_bsk TMA_OK",
    divisible="a_ptr b_ptr c_ptr as_ptr bs_ptr tile_expert_ptr M N K stride_am stride_be stride_bn stride_cm "
    "stride_ask stride_bse stride_bsn",
)
_GROUPED_WGRAD = dict(
    types=dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", as_ptr="*fp32", bs_ptr="*fp32", seg_ptr="*i32"),
    ints="N K stride_an stride_at stride_bk stride_bt stride_ce stride_cn stride_ck stride_asn stride_ast stride_bsk "
    "stride_bst M TMA_OK",
    divisible="a_ptr b_ptr c_ptr as_ptr bs_ptr N K stride_an stride_bk stride_ce stride_cn stride_ast stride_bst",
)
_ACT = dict(
    types=dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", qt_ptr="*fp8e4nv", st_ptr="*fp32"),
    ints="M K M_Q M_T stride_xm stride_xk stride_qm stride_sm stride_sk stride_stk stride_stm",
    divisible="x_ptr q_ptr s_ptr qt_ptr st_ptr M K M_Q M_T stride_xm stride_qm stride_sk stride_stm",
)
_WEIGHT = dict(
    types=dict(w_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", qt_ptr="*fp8e4nv", st_ptr="*fp32", amax_ptr="*fp32"),
    ints="N K stride_wn stride_wk KB T_ROWS T_BLOCKS stride_qt stride_st",
    divisible="w_ptr q_ptr s_ptr qt_ptr st_ptr amax_ptr N K stride_wn T_ROWS stride_qt",
)


def available() -> tuple[bool, str]:
    """Whether this Triton can compile for SM90 and read the result back."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False, "TRITON_INTERPRET=1 makes the kernels Python functions: unset it to compile them"
    missing = [tool for tool in ("ptxas", "cuobjdump") if not (_BIN / tool).exists()]
    return (False, f"triton {triton.__version__} ships no {', '.join(missing)}") if missing else (True, "")


def compile_sm90(fn, spec: dict, constexprs: dict, num_warps: int, num_stages: int):
    """`fn` compiled for sm_90a with these constexprs, its other arguments typed and specialized as `spec` says."""
    ints = spec["ints"].split()
    signature = {
        name: "constexpr" if name in constexprs else spec["types"].get(name, "i32" if name in ints else None)
        for name in fn.arg_names
    }
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in spec["divisible"].split()}
    attrs = {k: v for k, v in attrs.items() if fn.arg_names[k[0]] not in constexprs}
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=SM90, options=dict(num_warps=num_warps, num_stages=num_stages))


def ctas_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """How many CTAs of a kernel one H100/H200 SM holds at once: 64K registers (allocated per warp in units of 8
    per thread), 228 KiB of shared memory (1 KiB of it reserved per CTA) and 64 warps."""
    by_registers = 65536 // (-(-registers // 8) * 8 * 32 * num_warps)
    return min(by_registers, 228 * 1024 // (shared_bytes + 1024), 64 // num_warps)


def resources(kernel) -> dict:
    """Registers, stack bytes, shared memory, CTAs per SM and SASS instruction counts of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([_BIN / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True)
        sass = subprocess.run([_BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    out = dict(
        registers=int(re.search(r"REG:(\d+)", usage.stdout).group(1)),
        stack_bytes=int(re.search(r"STACK:(\d+)", usage.stdout).group(1)),
        shared_bytes=kernel.metadata.shared,
        ctas_per_sm=0,
        instructions=len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass)),
    )
    out.update({op: len(re.findall(rf"\b{op}[. ]", sass)) for op in SASS_OPS})
    out["LDG_128"] = len(re.findall(r"\bLDG\.E\.128\b", sass))  # 16-byte vector loads
    # Global loads issued before the first global store: how much of X or W a quantizer has in flight at once.
    memory_ops = re.findall(r"\b(LDG|STG)[. ]", sass)
    out["LDG_before_STG"] = memory_ops.index("STG") if "STG" in memory_ops else len(memory_ops)
    # Warp-specialized: Triton gives each warp group its own code and hands registers to the consumers.
    out["warp_specialized"] = "USETMAXREG" in sass
    out["num_warps"] = kernel.metadata.num_warps
    out["ctas_per_sm"] = ctas_per_sm(out["registers"], out["shared_bytes"], kernel.metadata.num_warps)
    return out


def compile_row(job: dict) -> dict:
    """`resources` of one kernel: `job["fn"]` (`"module.kernel"`, a kernel of `triton_gemm_kernels` or
    `triton_kernels` by name: a worker imports its own) compiled with `job`'s argument spec, constexprs, warps and
    stages. A worker's task."""
    module, name = job["fn"].split(".")
    fn = getattr({"triton_gemm_kernels": tg, "triton_kernels": tk}[module], name)
    return resources(compile_sm90(fn, job["spec"], job["const"], job["num_warps"], job["num_stages"]))


def compile_rows(jobs: list[dict], workers: int | None = None) -> list[dict]:
    """Every job compiled, one process per core (each compile is single-threaded Python and ptxas); each row named
    by its job's `kernel` pattern, which may name the compiled kernel's `num_warps`."""
    with ProcessPoolExecutor(workers or os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
        found = list(pool.map(compile_row, jobs))
    return [
        dict(kernel=job["kernel"].format(**res), weight_scales=job["weight_scales"], **res)
        for job, res in zip(jobs, found, strict=True)
    ]


def gemm_jobs() -> list[dict]:
    """`gemm_kernel` at every autotune config, with 128x128 weight scales (fprop, dgrad) and 1x128 (wgrad)."""
    jobs = []
    for cfg in tg.configs:
        for b_rows in (128, 1):
            const = dict(stride_ak=1, stride_bk=1, stride_cn=1, stride_asm=1, B_ROWS_PER_SCALE=b_rows, BLOCK_K=128)
            const["stride_bsk" if b_rows == 128 else "stride_bsn"] = 1  # row-major 128x128, column-major 1x128
            const.update(cfg.kwargs)
            name = (
                f"gemm {cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']}, {cfg.num_warps} warps, {cfg.num_stages} stages"
                + (", TMA, warp-specialized ({num_warps} warps in all)" if cfg.kwargs["TMA"] else "")
            )
            scales = "128x128" if b_rows == 128 else "1x128"
            jobs.append(
                _job("triton_gemm_kernels.gemm_kernel", _GEMM, const, cfg.num_warps, cfg.num_stages, name, scales)
            )
    return jobs


def grouped_jobs() -> list[dict]:
    """The MoE kernels (`grouped_gemm`, `grouped_wgrad`) at every autotune config (all 128x128 tiles)."""
    grouped = dict(stride_ak=1, stride_bk=1, stride_cn=1, stride_asm=1, stride_bsk=1, BLOCK_M=128, BLOCK_N=128)
    wgrad = dict(stride_at=1, stride_bt=1, stride_ck=1, stride_asn=1, stride_bsk=1, BLOCK_N=128, BLOCK_K=128)
    jobs = []
    for fn, spec, const, scales in (
        ("grouped_gemm_kernel", _GROUPED, grouped, "128x128"),
        ("grouped_wgrad_kernel", _GROUPED_WGRAD, wgrad, "1x128"),
    ):
        for cfg in tg.grouped_configs:
            name = f"{fn} 128x128, {cfg.num_warps} warps, {cfg.num_stages} stages" + (
                ", TMA, warp-specialized ({num_warps} warps in all)" if cfg.kwargs["TMA"] else ""
            )
            const = {**const, "BLOCK_K": 128, **cfg.kwargs}
            jobs.append(_job(f"triton_gemm_kernels.{fn}", spec, const, cfg.num_warps, cfg.num_stages, name, scales))
    return jobs


def _slices(cfg) -> str:
    """A quantizer config in words: its slice rows, warps, and the variants it turns on."""
    variants = [
        v for v, on in (("prefetch", cfg.kwargs["PREFETCH"]), ("running max", cfg.kwargs["RUNNING_MAX"])) if on
    ]
    return ", ".join([f"{cfg.kwargs['CHUNK']}-rows slices", f"{cfg.num_warps} warps", *variants])


def quantize_jobs() -> list[dict]:
    """`quant_act_kernel` (with Xᵀ) and `quant_weight_kernel` (with Wᵀ) at every autotune config."""
    jobs = []
    for cfg in tk._QUANT_CONFIGS:
        const = dict(stride_xk=1, stride_sm=1, stride_stk=1, POW2=False, WITH_T=True, BLOCK=128, **cfg.kwargs)
        name = f"quantize act, {_slices(cfg)}"
        jobs.append(_job("triton_kernels.quant_act_kernel", _ACT, const, cfg.num_warps, 1, name, ""))
    for cfg in tk._QUANT_CONFIGS:
        const = dict(stride_wk=1, POW2=False, WITH_T=True, BLOCK=128, **cfg.kwargs)
        name = f"quantize weight, {_slices(cfg)}"
        jobs.append(_job("triton_kernels.quant_weight_kernel", _WEIGHT, const, cfg.num_warps, 1, name, "128x128"))
    return jobs


def _job(fn: str, spec: dict, const: dict, num_warps: int, num_stages: int, kernel: str, weight_scales: str) -> dict:
    return dict(fn=fn, spec=spec, const=const, num_warps=num_warps, num_stages=num_stages, kernel=kernel,
                weight_scales=weight_scales)  # fmt: skip


def markdown(rows: list[dict]) -> str:
    head = [
        "kernel",
        "weight scales",
        "registers",
        "stack bytes",
        "shared KiB",
        "CTAs/SM",
        *SASS_OPS,
        "SASS instructions",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [r["kernel"], r["weight_scales"], r["registers"], r["stack_bytes"], f"{r['shared_bytes'] / 1024:.0f}",
                 r["ctas_per_sm"]]  # fmt: skip
        cells += [r[op] for op in SASS_OPS] + [r["instructions"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--gemm_only", action="store_true", help="only the GEMMs (half the compile time)")
    parser.add_argument("--workers", type=int, help="compiling processes (default: one per core)")
    args = parser.parse_args()
    ok, why = available()
    if not ok:
        raise SystemExit(why)
    rows = compile_rows(gemm_jobs() + grouped_jobs() + ([] if args.gemm_only else quantize_jobs()), args.workers)
    print(f"SM90 (sm_90a), triton {triton.__version__}; stack bytes > 0 are register spills\n")
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(triton=triton.__version__, rows=rows), indent=2))


if __name__ == "__main__":
    main()
