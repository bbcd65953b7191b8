"""Every GPU check and benchmark of trl-fp8 in one call: FP8 vs BF16 in the same run, as ratios.

    python benchmarks/gpu_bench.py --output_dir benchmarks/results/gpu      # one H200: a few minutes
    python benchmarks/gpu_bench.py --smoke --output_dir /tmp/gpu_bench       # tiny shapes, runs on CPU too

(a) block-FP8 GEMM TFLOP/s at Llama-3.1-8B shapes, (b) `FP8Linear` forward+backward with all its quantization,
(c) quantize bandwidth as a share of a device-to-device copy, (d) a training step of a random Llama-3.2-1B-shaped model
at 4096 tokens, tokens/s, (e) peak memory, (f) every fast path against the `emulated` oracle on the same inputs.
Writes `gpu_bench.json` and `gpu_bench.md`. On a machine without an SM90 GPU the fast backend is `emulated` and the
ratios mean nothing; `--smoke` exists to check the script itself there.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fp8 import FP8Recipe, convert_to_fp8
from trl_fp8.quant import FP8Linear, quantize_blockwise
from trl_fp8.quant.backends import emulated, resolve_backend


TARGETS = {"gemm": 1.6, "linear": 1.3, "quantize_share": 0.70, "train_step": 1.15}
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


def bench_gemm(device, backend, ms, shapes, iters):
    rows = []
    for m in ms:
        for k, n in shapes:
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            qa, sa = quantize_blockwise(a, (1, 128))
            qb, sb = quantize_blockwise(b, (128, 128))
            t_bf16 = timed(lambda: a @ b.t(), device, iters=iters)  # noqa: B023
            t_fp8 = timed(lambda: backend.gemm(qa, sa, qb, sb, (128, 128), torch.bfloat16), device, iters=iters)  # noqa: B023
            flops = 2 * m * n * k
            fast = backend.gemm(qa, sa, qb, sb, (128, 128), torch.float32)
            oracle = emulated.gemm(qa, sa, qb, sb, (128, 128), torch.float32)
            rows.append(
                dict(M=m, K=k, N=n, bf16_tflops=flops / t_bf16 / 1e12, fp8_tflops=flops / t_fp8 / 1e12,
                     ratio=t_bf16 / t_fp8, sqnr_vs_emulated_db=sqnr(oracle, fast))
            )  # fmt: skip
    return rows


def bench_linear(device, backend_name, m, shapes, iters):
    rows = []
    for k, n in shapes:
        lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        fp8 = FP8Linear.from_linear(
            nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16), backend=backend_name
        )
        oracle = FP8Linear.from_linear(
            nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16), backend="emulated"
        )
        oracle.weight = fp8.weight
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)

        def step(module, x=x):
            x.grad = None
            module.weight.grad = None
            module(x).float().square().mean().backward()

        def fp8_step(fp8=fp8):
            # The timed steps change no weight, so the weight cache would hold: drop it, as an optimizer step does.
            fp8._w_cache = None
            step(fp8)

        t_bf16 = timed(lambda: step(lin), device, iters=iters)  # noqa: B023
        t_fp8 = timed(fp8_step, device, iters=iters)
        step(fp8)
        dx, dw = x.grad.clone(), fp8.weight.grad.clone()
        step(oracle)
        rows.append(
            dict(M=m, K=k, N=n, ratio=t_bf16 / t_fp8, bf16_ms=t_bf16 * 1e3, fp8_ms=t_fp8 * 1e3,
                 dgrad_sqnr_vs_emulated_db=sqnr(x.grad, dx), wgrad_sqnr_vs_emulated_db=sqnr(oracle.weight.grad, dw))
        )  # fmt: skip
    return rows


def bench_quantize(device, m, k, iters):
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    t_copy = timed(lambda: x.clone(), device, iters=iters)
    copy_bw = 2 * x.numel() * x.element_size() / t_copy
    rows = {}
    for name, block in (("1x128", (1, 128)), ("128x128", (128, 128))):
        t = timed(lambda: quantize_blockwise(x, block, check_finite=False), device, iters=iters)  # noqa: B023
        moved = x.numel() * (x.element_size() + 1)  # read bf16, write e4m3 (scales are negligible)
        rows[name] = dict(bandwidth_gbs=moved / t / 1e9, share_of_copy=moved / t / copy_bw)
    rows["copy_bandwidth_gbs"] = copy_bw / 1e9
    return rows


def bench_train_step(device, backend_name, config: LlamaConfig, seq_len, iters):
    out = {}
    for label in ("bf16", "fp8"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
        if label == "fp8":
            convert_to_fp8(model, FP8Recipe(backend=backend_name))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(0, config.vocab_size, (1, seq_len), device=device)

        def step(model=model, opt=opt, ids=ids):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = timed(step, device, warmup=2, iters=iters)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        out[label] = dict(tokens_per_s=seq_len / t, step_ms=t * 1e3, peak_memory_gib=peak)
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["ratio"] = out["fp8"]["tokens_per_s"] / out["bf16"]["tokens_per_s"]
    return out


def markdown(results) -> str:
    lines = [f"Device: {results['device']}; FP8 backend: `{results['backend']}`; torch {results['torch']}", ""]
    lines += [
        "(a) GEMM",
        "",
        "| M | K | N | BF16 TFLOP/s | FP8 TFLOP/s | ratio | SQNR vs emulated (dB) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['M']} | {r['K']} | {r['N']} | {r['bf16_tflops']:.1f} | {r['fp8_tflops']:.1f} | {r['ratio']:.2f} | "
        f"{r['sqnr_vs_emulated_db']:.1f} |"
        for r in results["gemm"]
    ]
    lines += [
        "",
        "(b) FP8Linear forward+backward",
        "",
        "| M | K | N | ratio | dgrad / wgrad SQNR vs emulated (dB) |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['M']} | {r['K']} | {r['N']} | {r['ratio']:.2f} | {r['dgrad_sqnr_vs_emulated_db']:.1f} / "
        f"{r['wgrad_sqnr_vs_emulated_db']:.1f} |"
        for r in results["linear"]
    ]
    q = results["quantize"]
    lines += ["", f"(c) quantize: 1x128 {q['1x128']['share_of_copy']:.0%}, 128x128 {q['128x128']['share_of_copy']:.0%} "
              f"of copy bandwidth ({q['copy_bandwidth_gbs']:.0f} GB/s)"]  # fmt: skip
    t = results["train_step"]
    lines += ["", f"(d, e) train step: BF16 {t['bf16']['tokens_per_s']:.0f} tok/s ({t['bf16']['peak_memory_gib']:.1f} GiB), "
              f"FP8 {t['fp8']['tokens_per_s']:.0f} tok/s ({t['fp8']['peak_memory_gib']:.1f} GiB), ratio {t['ratio']:.2f}"]  # fmt: skip
    lines += [
        "",
        "Targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in results["targets_met"].items()),
    ]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="benchmarks/results/gpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, not the hardware")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend("auto", device)
    if args.smoke:
        ms, shapes, m_lin, iters, seq = [256], [(256, 384)], 256, 2, 128
        config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    else:
        ms, shapes, m_lin, iters, seq = [8192, 16384], GEMM_SHAPES, 8192, 10, 4096
        config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)  # fmt: skip
    results = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", backend=backend.name,
                   torch=torch.__version__, smoke=args.smoke)  # fmt: skip
    results["gemm"] = bench_gemm(device, backend, ms, shapes, iters)
    results["linear"] = bench_linear(device, backend.name, m_lin, shapes[:3], iters)
    results["quantize"] = bench_quantize(device, ms[0], shapes[0][0], iters)
    results["train_step"] = bench_train_step(device, backend.name, config, seq, max(2, iters // 2))
    results["targets_met"] = {
        "gemm >= 1.6x": min(r["ratio"] for r in results["gemm"]) >= TARGETS["gemm"],
        "linear >= 1.3x": min(r["ratio"] for r in results["linear"]) >= TARGETS["linear"],
        "quantize >= 70% of copy": min(results["quantize"][b]["share_of_copy"] for b in ("1x128", "128x128"))
        >= TARGETS["quantize_share"],
        "train step >= 1.15x": results["train_step"]["ratio"] >= TARGETS["train_step"],
        "fast paths match emulated (>= 35 dB)": all(r["sqnr_vs_emulated_db"] >= 35 for r in results["gemm"]),
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
    (out / "gpu_bench.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
