"""Whole-model sections of `gpu_bench.py`: (d, e) a training step's tokens/s and peak memory, (h) where its time
goes (`step_profile.py`), (g) one MoE layer's FP8 grouped experts; and the timing every section uses."""

import copy
import gc
import statistics
import time
import traceback
from functools import partial
from pathlib import Path

import torch
from step_profile import BENCH_SYNC, profile_summary  # benchmarks/, on sys.path when run as a script
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from trl_fp8 import FP8Recipe, convert_to_fp8
from trl_fp8.quant.moe import FP8Experts
from trl_fp8.quant.siblings import MLP_SIBLING_SETS, group_siblings


def timed(fn, device, warmup=3, iters=10) -> float:
    """Seconds per `fn()`: on a GPU the mean of `iters` calls queued back to back between two CUDA events; elsewhere
    the median of `iters` timed calls. (Host syncs around each call counted launch and sync latency too: on
    2026-12-04 a bf16 clone read as 2.6 TB/s, where the step's profile shows copies moving 4.2-4.3 TB/s.)"""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured(fn) -> dict:
    """`fn()`'s figures, or `{"error": its last line}`: one failing backend or label (an untried TE, an out-of-memory
    extra) must not cost the figures the others measured in the same section."""
    try:
        return fn()
    except Exception:
        print(traceback.format_exc(), flush=True)
        return dict(error=traceback.format_exc().strip().splitlines()[-1])


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(20 * torch.log10(ref.norm() / (ref - x).norm().clamp_min(1e-30)))


_BASE_MODEL: dict[str, nn.Module] = {}


def train_setup(device, label: str, config: LlamaConfig, seq_len: int, batch: int):
    """`(model, optimizer, step, losses)` of the training step (d) times and (h) profiles, for `label` ("bf16", an
    FP8 backend, "<backend> unfused": q/k/v and gate/up run alone, or "<backend> mlp-stacked": gate/up stacked as
    well as q/k/v, the default before 2026-12-04); every label starts from the same random weights and tokens."""
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
        if variant == "mlp-stacked":
            group_siblings(model, MLP_SIBLING_SETS)
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
    # `unfused`: the first backend once more with its sibling linears alone, to show what stacking them gives, and
    # with gate/up stacked too, to show what leaving them alone gives.
    first = next(iter(backends), "te")
    extra = [f"{first} unfused", f"{first} mlp-stacked"] if unfused and first != "te" else []

    def measure(label):
        if device.type == "cuda":
            gc.collect()  # the previous precision's model (or a failed label's) must be gone before (e) is measured
            torch.cuda.empty_cache()
        model, opt, step, losses = train_setup(device, label, config, seq_len, batch)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = timed(step, device, warmup=2, iters=iters)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        return dict(tokens_per_s=batch * seq_len / t, step_ms=t * 1e3, peak_memory_gib=peak,
                    losses=[round(float(v), 4) for v in losses])  # fmt: skip

    for label in ("bf16", *backends, *extra):
        out[label] = measured(partial(measure, label))
    for label in (*backends, *extra):
        if "tokens_per_s" in out[label] and "tokens_per_s" in out["bf16"]:
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
                # The device tool brings back files under 16 MiB.
                result["trace"] = path.name if size < 15 * 2**20 else f"dropped: {size / 2**20:.0f} MiB"
                if size >= 15 * 2**20:
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
