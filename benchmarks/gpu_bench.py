"""Every GPU check and benchmark of trl-fp8 in one call: FP8 vs BF16 in the same run, as ratios.

    python benchmarks/gpu_bench.py --output_dir benchmarks/results/gpu      # one H200: a few minutes
    python benchmarks/gpu_bench.py --smoke --output_dir /tmp/gpu_bench       # tiny shapes, runs on CPU too

(a) block-FP8 GEMM TFLOP/s at Llama-3.1-8B shapes, (b) `FP8Linear` forward+backward with all its quantization,
(c) quantize bandwidth as a share of a device-to-device copy, (d) a training step of a random Llama-3.2-1B-shaped model
at 4096 tokens, tokens/s (and, beside the targets, of two Llama-3.1-8B decoder layers under a 1024-token vocabulary:
the layers of the model NeMo RL's 15-25% faster steps were measured on, without a 1B model's large lm_head share),
(e) peak memory, (f) every fast path against the `emulated` oracle on the same inputs,
(g) a Qwen3-30B-A3B-shaped MoE layer, FP8 grouped experts vs transformers' BF16 experts, (h) where (d)'s step time
goes per precision: kernel time per category (GEMM, FP8 quantize, attention, optimizer, copies), GPU busy share,
launches and host syncs per step, top kernels (and `profile_<first FP8 backend>.json.gz`, a Perfetto trace),
(i) the host's time per linear forward + backward where kernels are microseconds, trl-fp8's own share of it,
and the host's time per call of each kernel a linear launches.
(d), (e), (g) and (h) are in `gpu_bench_model.py`, (i) in `host_overhead.py`, the report in `bench_report.py`.
Writes `gpu_bench.json`, `gpu_bench.md` and `gpu_targets.png` (every ratio against its target). On a machine without
an SM90 GPU the fast backend is `emulated` and the ratios mean nothing; `--smoke` exists to check the script itself
there.
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch
from bench_report import failed_measurements, markdown, plot_targets, targets  # benchmarks/: sys.path as a script
from gpu_bench_model import bench_moe, bench_profile, bench_train_step, measured, sqnr, timed
from host_overhead import bench_host
from torch import nn
from transformers import LlamaConfig

from trl_fp8.quant import FP8Linear, quantize_blockwise
from trl_fp8.quant.backends import BACKENDS, emulated, resolve_backend
from trl_fp8.quant.backends._quantize import fast_act, fast_weight, triton_status
from trl_fp8.quant.linear import _SharedActivation
from trl_fp8.quant.te_linear import te_linear_class, te_status


GEMM_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N) of Llama-3.1-8B


@contextlib.contextmanager
def _autotuning(backend: str, device, out: dict, label: str):
    """Where the block tunes the Triton GEMM for a new shape, `out[label]` gets the autotuner's timings (ms, median)
    of its best plain and (where switched on) its best warp-specialized TMA config: what the TMA configs win or
    lose, whichever it keeps."""
    if backend != "triton" or device.type != "cuda":
        yield
        return
    from trl_fp8.quant.backends.triton_gemm_kernels import gemm_kernel_tuned as tuner

    before = len(tuner.cache)
    yield
    if len(tuner.cache) == before:
        return
    best = {}
    for cfg, t in (getattr(tuner, "configs_timings", None) or {}).items():
        kind = "tma" if cfg.kwargs.get("TMA") else "plain"
        best[kind] = min(best.get(kind, math.inf), t[0] if isinstance(t, (list, tuple)) else t)
    out[label] = best


def _gemm_figures(name, mod, device, cases, bf16_flop_rate, iters) -> dict:
    """One backend's TFLOP/s, ratio to BF16 and (f) SQNR, with 128x128 and 1x128 B scales (`cases`: operands and the
    oracle's fp32 products). (f) is taken on the very calls timed: bf16 out (the autotuner keys on the dtype, so an
    fp32 call may run another tile)."""
    figures, tuning = {}, {}
    for scales, (operands, oracle) in cases.items():
        with _autotuning(name, device, tuning, scales):
            t = timed(partial(mod.gemm, *operands, torch.bfloat16), device, iters=iters)
        flops = 2 * operands[0].shape[0] * operands[2].shape[0] * operands[0].shape[1]
        suffix = "" if scales == "128x128" else "_1x128_b"
        figures[f"ratio{suffix}"] = flops / t / bf16_flop_rate
        if scales == "128x128":
            figures["tflops"] = flops / t / 1e12
        db = sqnr(oracle, mod.gemm(*operands, torch.bfloat16))
        figures["sqnr_vs_emulated_db" if scales == "128x128" else "sqnr_1x128_vs_emulated_db"] = db
    return {**figures, "autotune_ms": tuning} if tuning else figures


def bench_gemm(device, backends, ms, shapes, iters):
    """(a), and (f) for the GEMMs: each backend's TFLOP/s at every shape, with 128x128 and 1x128 B scales."""
    rows = []
    for m in ms:
        for k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            qa, sa = quantize_blockwise(a, (1, 128))
            qb, sb = quantize_blockwise(b, (128, 128))
            t_bf16 = timed(lambda: a @ b.t(), device, iters=iters)  # noqa: B023
            flops = 2 * m * n * k
            # wgrad's operands: both sides in 1x128 blocks (K is the token dim there).
            qb1, sb1 = quantize_blockwise(b, (1, 128))
            oracle = emulated.gemm(qa, sa, qb, sb, (128, 128), torch.float32)
            oracle_1x128 = emulated.gemm(qa, sa, qb1, sb1, (1, 128), torch.float32)
            row = dict(M=m, K=k, N=n, bf16_tflops=flops / t_bf16 / 1e12)
            cases = {
                "128x128": ((qa, sa, qb, sb, (128, 128)), oracle),
                "1x128": ((qa, sa, qb1, sb1, (1, 128)), oracle_1x128),
            }
            for name, mod in backends.items():
                row[name] = measured(partial(_gemm_figures, name, mod, device, cases, flops / t_bf16, iters))
            rows.append(row)
    if "triton" in backends and device.type == "cuda":
        from trl_fp8.quant.backends.triton_gemm_kernels import gemm_kernel_tuned

        # Which tile won, per (shape bucket, weight-scale rows, dtypes) key: the configs are chosen statically
        # (`sm90_static.py`: few or no spills, some at two CTAs per SM); this says which of them Hopper prefers.
        rows[-1]["triton_autotuned"] = {str(key): str(cfg) for key, cfg in gemm_kernel_tuned.cache.items()}
    return rows


def _linear_figures(name, lin, x, step, fp8_step, t_bf16, refs, iters) -> dict:
    """One backend's `FP8Linear` (or TE linear) forward+backward time, ratio to BF16, and dgrad/wgrad SQNR."""
    fp8 = (
        te_linear_class().from_linear(lin, pow2_scales=False, name="bench")
        if name == "te"
        else FP8Linear.from_linear(lin, backend=name)
    )
    t = timed(lambda: fp8_step(fp8), x.device, iters=iters)
    # Micro-batches after the first of an optimizer step reuse the quantized weight (X is new each time).
    t_cached = timed(lambda: (setattr(_SharedActivation, "entry", None), step(fp8)), x.device, iters=iters)
    step(fp8)
    # `fp8.weight`: TE's linear holds a copy of the weight (trl-fp8's holds `lin.weight` itself).
    return dict(ms=t * 1e3, ratio=t_bf16 / t, ratio_weight_cached=t_bf16 / t_cached,
                dgrad_sqnr_vs_emulated_db=sqnr(refs[0], x.grad),
                wgrad_sqnr_vs_emulated_db=sqnr(refs[1], fp8.weight.grad))  # fmt: skip


def bench_linear(device, backends, m, shapes, iters):
    rows = []
    for k, n in shapes:
        torch.manual_seed(0)
        lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)

        def step(module, x=x, dy=dy):
            x.grad = None
            module.weight.grad = None
            module(x).backward(dy)

        def fp8_step(module):
            # The timed steps change neither the weight nor X, so both quantizations would be reused: drop them, as
            # an optimizer step and a new batch do.
            module._w_cache = None
            _SharedActivation.entry = None
            step(module)

        t_bf16 = timed(lambda: step(lin), device, iters=iters)  # noqa: B023
        oracle = FP8Linear.from_linear(lin, backend="emulated")
        step(oracle)
        dx_ref, dw_ref = x.grad.clone(), lin.weight.grad.clone()
        row = dict(M=m, K=k, N=n, bf16_ms=t_bf16 * 1e3)
        for name in backends:
            row[name] = measured(
                partial(_linear_figures, name, lin, x, step, fp8_step, t_bf16, (dx_ref, dw_ref), iters)
            )
        rows.append(row)
    return rows


def bench_quantize(device, x_shape, w_shape, iters):
    # Large enough that a kernel's time is its memory traffic, not its launch, and W not held in L2 between calls
    # (a 4096 x 4096 weight moved 48-64 MB: about one autotuned launch's host time, its 32 MB input cached).
    x = torch.randn(*x_shape, device=device, dtype=torch.bfloat16)
    w = torch.randn(*w_shape, device=device, dtype=torch.bfloat16)
    t_copy = timed(lambda: x.clone(), device, iters=iters)
    copy_bw = 2 * x.numel() * x.element_size() / t_copy
    elems = x.numel()
    cases = {
        # name: (fn, bytes moved per element: bf16 read + e4m3 writes; scales are < 1%)
        "reference 1x128 (quantize_blockwise)": (lambda: quantize_blockwise(x, (1, 128), check_finite=False), 3),
        "reference 1x128 + transposed (two calls)": (
            lambda: (
                quantize_blockwise(x, (1, 128), check_finite=False),
                quantize_blockwise(x.t(), (1, 128), check_finite=False),
            ),
            6,
        ),  # fmt: skip
    }
    if triton_status()[0]:
        cases["fused 1x128 (triton)"] = (lambda: fast_act(x, False, False), 3)
        cases["fused 1x128 + transposed (triton, one pass)"] = (lambda: fast_act(x, False, True), 4)
        cases["weight 128x128 (triton, with finite check)"] = (lambda: fast_weight(w, (128, 128), False, "w"), 3)
        cases["weight 128x128 (triton, check deferred)"] = (lambda: fast_weight(w, (128, 128), False, "w", False), 3)
        cases["weight 128x128 + transposed (triton, one pass)"] = (
            lambda: fast_weight(w, (128, 128), False, "w", False, with_t=True),
            4,
        )  # fmt: skip
        cases["weight 128x128 + transpose copy (before 2026-12-04)"] = (
            lambda: [t.contiguous() for t in fast_weight(w, (128, 128), False, "w", False)[2:4]],
            5,
        )  # fmt: skip
    rows = {"copy_bandwidth_gbs": copy_bw / 1e9}
    for name, (fn, bytes_per_elem) in cases.items():
        n = w.numel() if name.startswith("weight") else elems
        t = timed(fn, device, iters=iters)
        rows[name] = dict(bandwidth_gbs=n * bytes_per_elem / t / 1e9, share_of_copy=n * bytes_per_elem / t / copy_bw)
    if triton_status()[0] and device.type == "cuda":
        from trl_fp8.quant.backends.triton_kernels import quant_act_kernel_tuned, quant_weight_kernel_tuned

        # Which config won (CHUNK rows, warps, PREFETCH, RUNNING_MAX), per (K, WITH_T, dtypes) key.
        rows["act_kernel_autotuned"] = {str(key): str(cfg) for key, cfg in quant_act_kernel_tuned.cache.items()}
        rows["weight_kernel_autotuned"] = {str(k): str(cfg) for k, cfg in quant_weight_kernel_tuned.cache.items()}
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="benchmarks/results/gpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, not the hardware")
    parser.add_argument("--train_batch", type=int, default=4, help="sequences of 4096 tokens per training step")
    parser.add_argument("--budget_s", type=float, default=420, help="skip the sections left after this many seconds")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # Every usable backend but the oracle, compared with BF16 in the same run; on CPU the oracle stands in.
    backends = {n: m for n, m in BACKENDS.items() if n != "emulated" and m.is_available(device)[0]}
    if device.type != "cuda":
        backends = {"emulated": resolve_backend("emulated")}
    gemm_backends = dict(backends)
    if device.type == "cuda" and te_status()[0]:
        backends["te"] = None  # module swap: measured in (b) and (d), not as a bare GEMM
    if args.smoke:
        ms, shapes, m_lin, iters, seq, batch = [256], [(256, 384)], 256, 2, 128, 2
        quant_shapes = (256, 256), (384, 256)
        config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
        config_8b = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    else:
        ms, shapes, m_lin, iters, seq, batch = [8192, 16384], GEMM_SHAPES, 8192, 10, 4096, args.train_batch
        quant_shapes = (32768, 4096), (28672, 4096)  # X: 4 x 8192 tokens; W: Llama-3.1-8B's gate/up
        config = LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        )  # fmt: skip
        config_8b = LlamaConfig(
            vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128,
        )  # fmt: skip
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    results = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   cuda=torch.version.cuda, triton=triton_version, smoke=args.smoke, backends=list(backends),
                   availability={n: m.is_available(device)[1] for n, m in BACKENDS.items()}, errors={},
                   skipped={})  # fmt: skip
    results["availability"]["te"] = te_status()[1]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections = [
        ("gemm", lambda: bench_gemm(device, gemm_backends, ms, shapes, iters)),
        ("linear", lambda: bench_linear(device, backends, m_lin, shapes, iters)),
        ("quantize", lambda: bench_quantize(device, *quant_shapes, iters)),
        # The host's time per linear (seconds, so early: the budget must not skip it), split into what trl-fp8's
        # Python costs (null kernels) and what the launches add.
        ("host", lambda: bench_host(device, {n: m for n, m in gemm_backends.items() if n != "emulated"}, iters * 20)),
        ("train_step", lambda: bench_train_step(device, backends, config, seq, batch, max(2, iters // 2), True)),
        # Same model and batch as train_step: 4 x 4096 tokens trace as few kernels as 1 x 4096, just longer ones.
        ("profile", lambda: bench_profile(device, backends, config, seq, batch, out)),
        ("moe", lambda: bench_moe(device, 256 if args.smoke else 8192, iters, args.smoke)),
        ("train_step_8b", lambda: bench_train_step(device, backends, config_8b, seq, batch, max(2, iters // 2))),
        # One sequence per step: small GEMMs, where per-kernel overheads show.
        ("train_step_1seq", lambda: bench_train_step(device, dict(list(backends.items())[:1]), config, seq, 1, 4)),
        # Whether that step waits on the GPU or on the host (busy share), which 4 x 4096 tokens cannot tell.
        ("profile_1seq", lambda: bench_profile(device, dict(list(backends.items())[:1]), config, seq, 1)),
    ]

    def save():
        # After every section, skipped ones too, and before each (`running`): a run the outer timeout kills leaves
        # every figure measured so far, and says where it stopped. Written aside, then renamed: never half a file.
        results["targets_met"] = targets(results)
        for name, text in (("gpu_bench.json", json.dumps(results, indent=2)), ("gpu_bench.md", markdown(results))):
            (out / f".{name}").write_text(text)
            os.replace(out / f".{name}", out / name)
        with contextlib.suppress(Exception):  # also drawn per section, for a run cut short
            plot_targets(results, out / "gpu_targets.png")

    for name, run in sections:
        if time.perf_counter() - started > args.budget_s:
            results["skipped"][name] = f"the {args.budget_s:.0f} s budget was spent"
            save()
            continue
        results["running"] = name
        save()
        t0 = time.perf_counter()
        try:
            results[name] = run()
        except Exception:  # one broken backend must not cost the other sections' figures
            results["errors"][name] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
        del results["running"]
        results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()
    print(markdown(results))
    try:
        print(f"wrote {plot_targets(results, out / 'gpu_targets.png')}")
    except ImportError:  # the lent GPU machine may have no matplotlib
        print(f"no matplotlib here: draw the figure with `python benchmarks/bench_report.py {out}` elsewhere")
    except Exception:  # a view of figures already written: it must not fail the run that measured them
        print(traceback.format_exc(), f"draw the figure with `python benchmarks/bench_report.py {out}`", flush=True)
    failed = sorted(results["errors"]) + failed_measurements(results)
    if failed:
        print(f"gpu_bench: failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
