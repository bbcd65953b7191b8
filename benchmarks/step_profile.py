"""(h) of `gpu_bench.py`: where a profiled training step's time went, from `torch.profiler` events.

Pure bookkeeping over the events: device kernel time (CPU op self time where there is no device) per category, the
GPU's busy share, launches, host syncs and their sources, and the top kernels; `profile_markdown` renders it.
"""

import collections
import re

import torch


# (h) sorts each device kernel (on CPU: each aten op) into the first category whose regex finds its name; amend here
# when a trace shows kernels landing in "other". Ours: Triton's `quant_act_kernel`, `quant_weight_kernel` and
# `gemm_kernel`.
PROFILE_CATEGORIES = {
    "fp8 quantize": r"quant_(act|weight)_kernel|quantize|cast_transpose",  # ours; TE's cast(+transpose) kernels
    "attention": r"flash|fmha|sdpa|attention|attn",  # before gemm: FlashAttention and cuDNN kernels run MMAs too
    "gemm": r"gemm|cublas|cutlass|nvjet|xmma|splitKreduce|scaled_mm|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$",
    "optimizer": r"multi_tensor|adam|foreach",
    "copy/pad/transpose": r"copy|memcpy|pad|transpose|contiguous|CatArray|^aten::(cat|clone|t|to)$",
}
# Enclosing ranges that claim everything run inside them, whatever its name, innermost first: Python frames (recorded
# on CPU only, where the emulated quantization and GEMM are plain aten ops) and record_function labels.
PROFILE_SCOPES = {
    "fp8 quantize": r"\b(quantize_blockwise|quantize_act|quantize_weight|reference_act|reference_weight|fast_act|"
    r"fast_weight|check_amax)\b",
    "gemm": r"emulated\.py\(\d+\): gemm$",  # the oracle's dequantize + fp32 matmul
    "optimizer": r"^Optimizer\.(step|zero_grad)#",
}
_CATEGORY_RES = [(c, re.compile(rx, re.IGNORECASE)) for c, rx in PROFILE_CATEGORIES.items()]
_SCOPE_RES = [(c, re.compile(rx)) for c, rx in PROFILE_SCOPES.items()]
_PYTHON_EVENT = re.compile(r"^<built-in |\.py\(\d+\): |^nn\.Module: ")  # for a torch without `is_python_function`
_RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")  # cudaLaunchKernel, cuLaunchKernelEx, cudaStreamSynchronize...
_SYNC_CALLS = re.compile(r"^cu(da)?((Stream|Device|Event|Ctx)Synchroni[sz]e|Memcpy$)")  # calls that wait for the GPU
BENCH_SYNC = "gpu_bench: timing sync"


def _match(table, name: str) -> str | None:
    return next((category for category, rx in table if rx.search(name)), None)


def _inherited(event, own, memo: dict) -> str | None:
    """`own()` of the innermost of `event` and its CPU ancestors that has one; memoized along the chain."""
    path, e = [], event
    while e is not None and id(e) not in memo:
        path.append(e)
        e = getattr(e, "cpu_parent", None)
    found = memo[id(e)] if e is not None else None
    for p in reversed(path):
        found = own(p) or found
        memo[id(p)] = found
    return found


def _ancestors(e) -> list:
    """The CPU events enclosing `e`, innermost first."""
    chain = []
    while (e := getattr(e, "cpu_parent", None)) is not None:
        chain.append(e)
    return chain


def _scope_own(e) -> str | None:
    return _match(_SCOPE_RES, e.name) or next(
        (c for frame in getattr(e, "stack", None) or () if (c := _match(_SCOPE_RES, str(frame)))), None
    )


def _is_device(e) -> bool:
    device_type = getattr(e, "device_type", None)
    return device_type is not None and device_type != torch.autograd.DeviceType.CPU


def _device_us(e) -> float:
    us = getattr(e, "self_device_time_total", None)
    if us is None:
        us = getattr(e, "self_cuda_time_total", 0)
    # Kineto marks a kernel async when it starts and ends on different device "threads", and async events report 0.
    return us or e.time_range.elapsed_us()


def profile_summary(events, steps: int, wall_s: float, on_device: bool) -> dict:
    """Where `steps` profiled training steps of `wall_s` seconds went: device kernel time (CPU op self time without a
    device) per `PROFILE_CATEGORIES` entry, GPU busy share, launches, host syncs and the top kernels."""
    cpu = [e for e in events if not _is_device(e)]
    scope_memo, op_memo = {}, {}

    def scope_of(e):
        return _inherited(e, _scope_own, scope_memo)

    def op_of(e):  # the category of the innermost enclosing aten op that has one: a fill inside a pad is padding
        return _inherited(e, lambda p: _match(_CATEGORY_RES, p.name) if p.name.startswith("aten::") else None, op_memo)

    # gpu_user_annotation events span other kernels on the device timeline: counting them would count twice.
    kernels = [e for e in events if _is_device(e) and not getattr(e, "is_user_annotation", False)
               and "annotation" not in str(getattr(e, "activity_type", "") or "")]  # fmt: skip
    timed_events = []  # (name, category, microseconds)
    python = []  # per CPU event: a Python frame (CPU path only)
    if kernels:
        # A kernel's id is the correlation id of the runtime call that launched it (cudaLaunchKernel, or Triton's
        # cuLaunchKernelEx), a CPU event nested in the ops and scopes that made the call. CPU ops' ids are another
        # numbering, so only runtime calls are keyed (`FunctionEvent` keeps no link from a kernel to its op).
        launchers = {e.id: e for e in cpu if _RUNTIME_CALL.search(e.name)}
        for k in kernels:
            op = launchers.get(k.id)
            category = (scope_of(op) if op else None) or _match(_CATEGORY_RES, k.name) or (op_of(op) if op else None)
            timed_events.append((k.name, category or "other", _device_us(k)))
        # Busy is the union of kernel intervals: kernels on two streams at once are not twice busy.
        busy_us, end = 0.0, float("-inf")
        for start, stop in sorted((k.time_range.start, k.time_range.end) for k in kernels):
            busy_us += max(0.0, stop - max(start, end))
            end = max(end, stop)
    else:
        python = [bool(getattr(e, "is_python_function", _PYTHON_EVENT.search(e.name))) for e in cpu]
        ops = [
            e for e, is_python in zip(cpu, python, strict=True)
            if not is_python and not getattr(e, "is_user_annotation", False) and not getattr(e, "is_async", False)
            and e.name != "[memory]" and not _RUNTIME_CALL.search(e.name)
        ]  # fmt: skip
        for e in ops:
            category = scope_of(e) or _match(_CATEGORY_RES, e.name) or (op_of(e.cpu_parent) if e.cpu_parent else None)
            timed_events.append((e.name, category or "other", getattr(e, "self_cpu_time_total", 0)))
        busy_us = sum(us for _, _, us in timed_events)

    step_us = wall_s / steps * 1e6
    per_category = dict.fromkeys([*PROFILE_CATEGORIES, "other"], 0.0)
    by_name: dict[str, list] = {}
    for name, category, us in timed_events:
        per_category[category] += us
        entry = by_name.setdefault(name, [0.0, 0, collections.Counter()])
        entry[0] += us
        entry[1] += 1
        entry[2][category] += us
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    # `.item()`, `bool()` and `int()` of a tensor dispatch to `_local_scalar_dense`. On a GPU only those that wait for
    # the device count: AdamW's step counters live on the CPU and `.item()` them per parameter, without a sync.
    items = [e for e in cpu if e.name == "aten::_local_scalar_dense"]
    sources = collections.Counter()
    if on_device and any(_RUNTIME_CALL.search(e.name) for e in cpu):  # the runtime calls were recorded
        ours = [e.time_range for e in cpu if e.name == BENCH_SYNC]
        waits = [
            e for e in cpu
            if _SYNC_CALLS.search(e.name)
            and not any(r.start <= e.time_range.start and e.time_range.end <= r.end for r in ours)
        ]  # fmt: skip
        synced = set()
        for e in waits:
            chain = _ancestors(e)
            synced.update(id(a) for a in chain if a.name == "aten::_local_scalar_dense")
            sources[next((a.name for a in reversed(chain) if a.name.startswith("aten::")), "(no aten op)")] += 1
        items = [e for e in items if id(e) in synced]
    else:
        waits = []
        for e in items:
            sources[next(a.name for a in reversed([e, *_ancestors(e)]) if a.name.startswith("aten::"))] += 1
    out = dict(
        # A GPU whose profiler recorded no kernels (CUPTI unavailable) still gets the host's side of the story.
        # Some builds record no Python frames with `with_stack` (torch 2.9's CUDA wheel on a machine without a GPU):
        # the emulated backend's quantization is then plain aten ops, counted under "gemm", "copy" or "other".
        time_base="cuda kernels" if kernels else "cpu ops (no cuda kernels recorded)" if on_device else (
            "cpu ops" if any(python) else "cpu ops (no Python frames recorded: fp8 quantize unseen)"
        ),
        step_ms=step_us / 1e3,
        categories={c: dict(ms=us / steps / 1e3, share=us / steps / step_us) for c, us in per_category.items()},
        busy_share=busy_us / steps / step_us,
        launches_per_step=len(timed_events) / steps,
        host_syncs=len(items),
        host_syncs_per_step=len(items) / steps,
        # By the outermost aten op they came from: each runtime wait on a GPU, each `_local_scalar_dense` on CPU.
        sync_sources_per_step={k: v / steps for k, v in sources.most_common()},
        top=[dict(name=name[:80], category=v[2].most_common(1)[0][0], calls_per_step=v[1] / steps,
                  ms_per_step=v[0] / steps / 1e3) for name, v in top],
    )  # fmt: skip
    if on_device:
        out["sync_calls_per_step"] = len(waits) / steps  # stream/device/event synchronize, our timing's left out
    return out


def profile_markdown(prof: dict) -> list[str]:
    labels = [k for k in prof if k != "shape"]
    ok = [k for k in labels if "error" not in prof[k]]
    bases = sorted({prof[k]["time_base"] for k in ok})
    lines = ["", f"(h) where a training step's time goes, {prof.get('shape', '')}; time base: {', '.join(bases)}; "
             "ms per step (share of the profiled step's wall time)", ""]  # fmt: skip
    lines += [f"**{k} failed**: `{prof[k]['error'].strip().splitlines()[-1]}`" for k in labels if k not in ok]
    if not ok:
        return lines
    lines += ["| category | " + " | ".join(ok) + " |", "|---" * (1 + len(ok)) + "|"]
    for category in prof[ok[0]]["categories"]:
        cells = [prof[k]["categories"].get(category, dict(ms=0.0, share=0.0)) for k in ok]
        lines.append(f"| {category} | " + " | ".join(f"{c['ms']:.1f} ({c['share']:.0%})" for c in cells) + " |")
    rows = {
        "step ms, profiled (unprofiled)": lambda v: f"{v['step_ms']:.1f} ({v.get('step_ms_unprofiled', 0):.1f})",
        "busy share (rest: launch/host bound)": lambda v: f"{v['busy_share']:.0%}",
        "launches/step (cpu: aten op calls)": lambda v: f"{v['launches_per_step']:.0f}",
        "host syncs/step (runtime sync calls)": lambda v: (
            f"{v['host_syncs_per_step']:g}"
            + (f" ({v['sync_calls_per_step']:g})" if "sync_calls_per_step" in v else "")
        ),
        "sync sources/step": lambda v: ", ".join(
            f"{k.removeprefix('aten::')} {n:g}" for k, n in list(v.get("sync_sources_per_step", {}).items())[:3]
        ),
    }
    lines += [f"| {name} | " + " | ".join(cell(prof[k]) for k in ok) + " |" for name, cell in rows.items()]
    for k in ok:
        trace = f", trace: {prof[k]['trace']}" if "trace" in prof[k] else ""
        lines += ["", f"Top {len(prof[k]['top'])} by time, {k}{trace}", "",
                  "| ms/step | calls/step | category | name |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {t['ms_per_step']:.2f} | {t['calls_per_step']:g} | {t['category']} | "
                  f"`{t['name'].replace('|', '/')}` |" for t in prof[k]["top"]]  # fmt: skip
    return lines
