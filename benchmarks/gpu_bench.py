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
launches and host syncs per step, top kernels (and `profile_<first FP8 backend>.json.gz`, a Perfetto trace).
Writes `gpu_bench.json`, `gpu_bench.md` and `gpu_targets.png` (every ratio against its target). On a machine without
an SM90 GPU the fast backend is `emulated` and the ratios mean nothing; `--smoke` exists to check the script itself
there.
"""

import argparse
import contextlib
import copy
import gc
import json
import math
import statistics
import time
import traceback
from functools import partial
from pathlib import Path

import torch
from bench_report import markdown, plot_targets, targets  # benchmarks/, on sys.path when run as a script
from step_profile import BENCH_SYNC, profile_summary
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from trl_fp8 import FP8Recipe, convert_to_fp8
from trl_fp8.quant import FP8Linear, quantize_blockwise
from trl_fp8.quant.backends import BACKENDS, emulated, resolve_backend
from trl_fp8.quant.backends._quantize import fast_act, fast_weight, triton_status
from trl_fp8.quant.linear import _SharedActivation
from trl_fp8.quant.moe import FP8Experts
from trl_fp8.quant.te_linear import te_linear_class, te_status


GEMM_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N) of Llama-3.1-8B


def timed(fn, device, warmup=3, iters=10) -> float:
    """Median seconds of `fn()`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(20 * torch.log10(ref.norm() / (ref - x).norm().clamp_min(1e-30)))


@contextlib.contextmanager
def _autotuning(backend: str, device, out: dict, label: str):
    """Where the block tunes the Triton GEMM for a new shape, `out[label]` gets the autotuner's timings (ms, median)
    of its best plain and its best warp-specialized TMA config: what the TMA configs win or lose, whichever it keeps."""
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


def bench_gemm(device, backends, ms, shapes, iters):
    rows = []
    for m in ms:
        for k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            qa, sa = quantize_blockwise(a, (1, 128))
            qb, sb = quantize_blockwise(b, (128, 128))
            t_bf16 = timed(lambda: a @ b.t(), device, iters=iters)  # noqa: B023
            flops = 2 * m * n * k
            oracle = emulated.gemm(qa, sa, qb, sb, (128, 128), torch.float32)
            row = dict(M=m, K=k, N=n, bf16_tflops=flops / t_bf16 / 1e12)
            # wgrad's operands: both sides in 1x128 blocks (K is the token dim there).
            qb1, sb1 = quantize_blockwise(b, (1, 128))
            for name, mod in backends.items():
                operands = (qa, sa, qb, sb, (128, 128))
                tuning = {}
                with _autotuning(name, device, tuning, "128x128"):
                    t = timed(partial(mod.gemm, *operands, torch.bfloat16), device, iters=iters)
                with _autotuning(name, device, tuning, "1x128"):
                    t1 = timed(partial(mod.gemm, qa, sa, qb1, sb1, (1, 128), torch.bfloat16), device, iters=iters)
                row[name] = dict(tflops=flops / t / 1e12, ratio=t_bf16 / t, ratio_1x128_b=t_bf16 / t1,
                                 sqnr_vs_emulated_db=sqnr(oracle, mod.gemm(*operands, torch.float32)))  # fmt: skip
                if tuning:
                    row[name]["autotune_ms"] = tuning
            rows.append(row)
    if "triton" in backends and device.type == "cuda":
        from trl_fp8.quant.backends.triton_gemm_kernels import gemm_kernel_tuned

        # Which tile won, per (shape bucket, weight-scale rows, dtypes) key: the configs are chosen statically
        # (`sm90_static.py`: few or no spills, some at two CTAs per SM); this says which of them Hopper prefers.
        rows[-1]["triton_autotuned"] = {str(key): str(cfg) for key, cfg in gemm_kernel_tuned.cache.items()}
    return rows


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
            if name == "te":
                fp8 = te_linear_class().from_linear(lin, pow2_scales=False, name="bench")
            else:
                fp8 = FP8Linear.from_linear(lin, backend=name)
            t = timed(lambda: fp8_step(fp8), device, iters=iters)  # noqa: B023
            # Micro-batches after the first of an optimizer step reuse the quantized weight (X is new each time).
            t_cached = timed(
                lambda: (setattr(_SharedActivation, "entry", None), step(fp8)),  # noqa: B023
                device,
                iters=iters,
            )
            step(fp8)
            row[name] = dict(ms=t * 1e3, ratio=t_bf16 / t, ratio_weight_cached=t_bf16 / t_cached,
                             dgrad_sqnr_vs_emulated_db=sqnr(dx_ref, x.grad),
                             wgrad_sqnr_vs_emulated_db=sqnr(dw_ref, lin.weight.grad))  # fmt: skip
        rows.append(row)
    return rows


def bench_quantize(device, m, k, iters):
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(k, k, device=device, dtype=torch.bfloat16)
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
    rows = {"copy_bandwidth_gbs": copy_bw / 1e9}
    for name, (fn, bytes_per_elem) in cases.items():
        n = w.numel() if name.startswith("weight") else elems
        t = timed(fn, device, iters=iters)
        rows[name] = dict(bandwidth_gbs=n * bytes_per_elem / t / 1e9, share_of_copy=n * bytes_per_elem / t / copy_bw)
    if triton_status()[0] and device.type == "cuda":
        from trl_fp8.quant.backends.triton_kernels import quant_act_kernel_tuned

        # Which slicing won (CHUNK rows; pass 2 by row or column slices), per (K, WITH_T, dtypes) key.
        rows["act_kernel_autotuned"] = {str(key): str(cfg) for key, cfg in quant_act_kernel_tuned.cache.items()}
    return rows


_BASE_MODEL: dict[str, nn.Module] = {}


def train_setup(device, label: str, config: LlamaConfig, seq_len: int, batch: int):
    """`(model, optimizer, step, losses)` of the training step (d) times and (h) profiles, for `label` ("bf16", an
    FP8 backend, or "<backend> unfused": q/k/v and gate/up run alone); every label starts from the same random
    weights and tokens."""
    key = config.to_json_string()
    if key not in _BASE_MODEL:
        # A 1B model's random init on the CPU takes tens of seconds: once per run and shape, not per precision and
        # section.
        torch.manual_seed(0)
        _BASE_MODEL[key] = LlamaForCausalLM(config).to(dtype=torch.bfloat16)
    model = copy.deepcopy(_BASE_MODEL[key]).to(device)
    if label != "bf16":
        backend, _, variant = label.partition(" ")
        convert_to_fp8(model, FP8Recipe(backend=backend, fuse_siblings=variant != "unfused"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)
    losses = []

    def step():
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return model, opt, step, losses


def bench_train_step(device, backends, config: LlamaConfig, seq_len, batch, iters, unfused=False):
    out = {}
    # `unfused`: the first backend once more with its sibling linears alone, to show what stacking them gives.
    extra = [f"{next(iter(backends))} unfused"] if unfused and backends and next(iter(backends)) != "te" else []
    for label in ("bf16", *backends, *extra):
        model, opt, step, losses = train_setup(device, label, config, seq_len, batch)
        if device.type == "cuda":
            gc.collect()  # the previous precision's model must be gone before (e) is measured
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = timed(step, device, warmup=2, iters=iters)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        out[label] = dict(tokens_per_s=batch * seq_len / t, step_ms=t * 1e3, peak_memory_gib=peak,
                          losses=[round(float(v), 4) for v in losses])  # fmt: skip
        del model, opt, step
    for label in (*backends, *extra):
        out[label]["ratio"] = out[label]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
    out["shape"] = f"{batch} x {seq_len} tokens per step"
    return out


def bench_profile(device, backends, config: LlamaConfig, seq_len, batch, trace_dir: Path | None = None, steps=2):
    """(h) Where (d)'s training step spends its time, per precision: `profile_summary` of `steps` profiled steps
    after two warm-up steps (and two timed without the profiler, whose own overhead the profiled wall time holds)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])

    def sync():
        if on_device:
            with record_function(BENCH_SYNC):
                torch.cuda.synchronize()

    def profile_one(label):
        model, opt, step, _ = train_setup(device, label, config, seq_len, batch)
        unprofiled = timed(step, device, warmup=2, iters=2)
        # Stacks only on CPU: there they tell the emulated quantization's aten ops from the rest; on a GPU our kernels
        # carry their own names, and the Python tracer would inflate the host time this measures.
        with profile(activities=activities, with_stack=not on_device) as prof:
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            wall = time.perf_counter() - start
        del model, opt, step
        result = profile_summary(prof.events(), steps, wall, on_device)
        result["step_ms_unprofiled"] = unprofiled * 1e3
        if trace_dir is not None and label == next(iter(backends), None):
            # One FP8 trace to open in Perfetto when the categories are not enough; dropped when it is too big.
            path = trace_dir / f"profile_{label}.json.gz"
            try:
                prof.export_chrome_trace(str(path))
                size = path.stat().st_size
                result["trace"] = path.name if size < 20 * 2**20 else f"dropped: {size / 2**20:.0f} MiB"
                if size >= 20 * 2**20:
                    path.unlink()
            except Exception as err:  # the figures above matter more than the trace
                result["trace"] = f"failed: {err!r}"[:200]
        return result

    out = dict(shape=f"{batch} x {seq_len} tokens per step, {steps} steps profiled after 2 warm-up steps")
    for label in ("bf16", *backends):
        try:
            out[label] = profile_one(label)
        except Exception:  # one broken precision must not cost the others' profiles
            out[label] = dict(error=traceback.format_exc()[-2000:])
            print(out[label]["error"], flush=True)
        if on_device:
            gc.collect()
            torch.cuda.empty_cache()
    return out


def bench_moe(device, tokens: int, iters: int, smoke: bool):
    """(g) One Qwen3-30B-A3B-shaped MoE layer (128 experts, top-8, H 2048, I 768), forward+backward: transformers'
    BF16 experts (eager loop and `grouped_mm`) vs FP8Experts' grouped Triton kernels; the grouped path is also
    checked against FP8Experts' per-expert loop on the same backend."""
    kw = (
        dict(hidden_size=256, moe_intermediate_size=128, num_experts=8)
        if smoke
        else dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128)
    )
    torch.manual_seed(0)
    x = torch.randn(tokens, kw["hidden_size"], device=device, dtype=torch.bfloat16)
    top_k_index = torch.stack([torch.randperm(kw["num_experts"], device=device)[:8] for _ in range(tokens)])
    top_k_weights = torch.rand(tokens, 8, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def step(run, x=x):
        x = x.detach().requires_grad_()
        run(x, top_k_index, top_k_weights).backward(dy)
        return x.grad

    out, ref_grad = {}, None
    for impl in ("eager", "grouped_mm"):
        config = Qwen3MoeConfig(**kw, num_experts_per_tok=8, hidden_act="silu", experts_implementation=impl)
        experts = Qwen3MoeExperts(config).to(device=device, dtype=torch.bfloat16)
        torch.nn.init.normal_(experts.gate_up_proj, std=0.02)
        torch.nn.init.normal_(experts.down_proj, std=0.02)
        try:
            out[f"bf16 {impl}"] = dict(ms=timed(lambda experts=experts: step(experts), device, iters=iters) * 1e3)
            ref_grad = step(experts)
        except Exception as err:  # grouped_mm needs a recent GPU and torch
            out[f"bf16 {impl}"] = dict(error=repr(err)[:200])
    fp8 = FP8Experts(copy.deepcopy(experts), backend="triton" if device.type == "cuda" else "emulated")
    ms = timed(lambda: step(fp8), device, iters=iters) * 1e3
    grad = step(fp8)
    looped = step(fp8.forward_per_expert)
    out["fp8 grouped"] = dict(
        ms=ms, dx_sqnr_vs_bf16_db=sqnr(ref_grad, grad), dx_sqnr_vs_per_expert_db=sqnr(looped, grad)
    )
    best_bf16 = min(v["ms"] for k, v in out.items() if k.startswith("bf16") and "ms" in v)
    out["fp8 grouped"]["ratio_vs_best_bf16"] = best_bf16 / ms
    if device.type == "cuda":  # plain or warp-specialized TMA kernel, per GEMM shape
        from trl_fp8.quant.backends import triton_gemm_kernels as tg

        tuners = {"grouped_gemm": tg.grouped_gemm_kernel_tuned, "grouped_wgrad": tg.grouped_wgrad_kernel_tuned}
        out["fp8 grouped"]["autotuned"] = {
            f"{name} {key}": str(cfg) for name, tuner in tuners.items() for key, cfg in tuner.cache.items()
        }
    return out


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
        config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
        config_8b = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    else:
        ms, shapes, m_lin, iters, seq, batch = [8192, 16384], GEMM_SHAPES, 8192, 10, 4096, args.train_batch
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
                   availability={n: m.is_available(device)[1] for n, m in BACKENDS.items()}, errors={})  # fmt: skip
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections = [
        ("gemm", lambda: bench_gemm(device, gemm_backends, ms, shapes, iters)),
        ("linear", lambda: bench_linear(device, backends, m_lin, shapes, iters)),
        ("quantize", lambda: bench_quantize(device, ms[0], shapes[0][0], iters)),
        ("train_step", lambda: bench_train_step(device, backends, config, seq, batch, max(2, iters // 2), True)),
        # Same model and batch as train_step: 4 x 4096 tokens trace as few kernels as 1 x 4096, just longer ones.
        ("profile", lambda: bench_profile(device, backends, config, seq, batch, out)),
        ("moe", lambda: bench_moe(device, 256 if args.smoke else 8192, iters, args.smoke)),
        ("train_step_8b", lambda: bench_train_step(device, backends, config_8b, seq, batch, max(2, iters // 2))),
        # One sequence per step: small GEMMs, where per-kernel overheads show.
        ("train_step_1seq", lambda: bench_train_step(device, dict(list(backends.items())[:1]), config, seq, 1, 4)),
    ]
    for name, run in sections:
        if time.perf_counter() - started > args.budget_s:
            results["errors"][name] = f"skipped: the {args.budget_s:.0f} s budget was spent"
            continue
        t0 = time.perf_counter()
        try:
            results[name] = run()
        except Exception:  # one broken backend must not cost the other sections' figures
            results["errors"][name] = traceback.format_exc()
            print(traceback.format_exc(), flush=True)
        results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        results["targets_met"] = targets(results)
        (out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
        (out / "gpu_bench.md").write_text(markdown(results))
    print(markdown(results))
    try:
        print(f"wrote {plot_targets(results, out / 'gpu_targets.png')}")
    except ImportError:  # the lent GPU machine may have no matplotlib
        print(f"no matplotlib here: draw the figure with `python benchmarks/bench_report.py {out}` elsewhere")
    except Exception:  # a view of figures already written: it must not fail the run that measured them
        print(traceback.format_exc(), f"draw the figure with `python benchmarks/bench_report.py {out}`", flush=True)


if __name__ == "__main__":
    main()
