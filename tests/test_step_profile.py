"""(h)'s bookkeeping (`benchmarks/step_profile.py`) on the events of a CUDA profile.

A CUDA profile cannot be recorded on a CPU, so the events here are torch's own `FunctionEvent`s, built by hand in
the layout `torch.profiler` gives a CUDA run (the one stand-in in this file): each kernel is a device event whose id
is the correlation id of the runtime call that launched it, and that call is a CPU event nested in the op, or the
`record_function` scope, that made it. CPU ops' ids are another numbering and may equal a runtime call's id. The CPU
path of (h) runs for real in `tests/test_examples.py::test_gpu_bench_smoke`.
"""

import sys
from pathlib import Path

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from step_profile import profile_summary  # noqa: E402


def _cpu(id_, name, start, end, parent=None):
    event = FunctionEvent(id=id_, name=name, thread=1, start_us=start, end_us=end, use_device="cuda")
    if parent is not None:
        event.set_cpu_parent(parent)
        parent.append_cpu_child(event)
    return event


def _kernel(id_, name, start, end):
    return FunctionEvent(
        id=id_, name=name, thread=7, start_us=start, end_us=end, use_device="cuda", device_type=DeviceType.CUDA
    )


def test_kernels_are_charged_to_the_op_or_scope_that_launched_them():
    copy = _cpu(901, "aten::copy_", 0, 50)  # same id as the quantizer's launch below, on purpose
    copy_launch = _cpu(900, "cudaLaunchKernel", 5, 10, parent=copy)
    scope = _cpu(11, "quantize_act", 60, 100)  # a record_function label around a Triton launch
    triton_launch = _cpu(901, "cuLaunchKernelEx", 70, 75, parent=scope)
    events = [
        copy,
        copy_launch,
        scope,
        triton_launch,
        # Names that match no category: only the launching op or scope can place them.
        _kernel(900, "void at::native::elementwise_kernel<128, 4>", 20, 40),
        _kernel(901, "fused_tile_kernel", 80, 95),
        # No runtime call recorded for it: placed by its own name, overlapping the one before on another stream.
        _kernel(999, "nvjet_tst_128x256_64x4", 90, 130),
    ]
    out = profile_summary(events, steps=1, wall_s=200e-6, on_device=True)
    ms = {c: v["ms"] for c, v in out["categories"].items()}
    assert ms["copy/pad/transpose"] == pytest.approx(0.020)
    assert ms["fp8 quantize"] == pytest.approx(0.015)
    assert ms["gemm"] == pytest.approx(0.040)
    assert ms["other"] == 0
    assert out["time_base"] == "cuda kernels" and out["launches_per_step"] == 3
    # Busy time is the union of kernel intervals: 20-40 and 80-130 of 200 us.
    assert out["busy_share"] == pytest.approx(70 / 200)


@pytest.mark.parametrize("frames", [True, False])
def test_cpu_time_base_says_whether_python_frames_placed_the_quantization(frames):
    # On CPU the emulated quantizer is plain aten ops: only its Python frame tells it from the GEMM's. A profile that
    # recorded no frames (torch 2.9's CUDA wheel without a GPU) must say that "fp8 quantize" could not be seen.
    amax = _cpu(2, "aten::amax", 10, 30)
    if frames:
        frame = _cpu(1, "trl_fp8/quant/blockwise.py(79): quantize_blockwise", 0, 40)
        frame.is_python_function = True  # a constructor argument only from torch 2.10
        amax.set_cpu_parent(frame)
        frame.append_cpu_child(amax)
    events = [frame, amax] if frames else [amax]
    out = profile_summary(events, steps=1, wall_s=100e-6, on_device=False)
    assert out["categories"]["fp8 quantize"]["ms"] == pytest.approx(0.020 if frames else 0.0)
    assert out["time_base"] == ("cpu ops" if frames else "cpu ops (no Python frames recorded: fp8 quantize unseen)")
    assert out["launches_per_step"] == 1  # the frame is not an op
