"""FSDP2 on CPU processes, for tests: accelerate runs an FSDP config on CPU as plain data parallelism (it takes FSDP
only for accelerator devices: `AcceleratorState` keeps `MULTI_CPU`), although FSDP2 itself (`fully_shard`) runs on
CPU over gloo. `allow_fsdp_on_cpu()` lifts that gate and nothing else: the model is then sharded and trained by
FSDP2 for real (accelerate's `fsdp2_prepare_model`, TRL's `prepare_fsdp`). Run as a script, it runs another one so:

    accelerate launch --config_file tests/scripts/fsdp2_cpu.yaml tests/scripts/fsdp_on_cpu.py \
        examples/grpo_fp8.py --config recipes/demo_cpu.yaml --per_device_train_batch_size 64
"""

import os
import runpy
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType


def allow_fsdp_on_cpu() -> None:
    """Call before the `Accelerator` is built (before the trainer)."""
    init = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            # Shared state: every later `AcceleratorState()` and `PartialState()` reads the same type.
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = __init__


if __name__ == "__main__":
    allow_fsdp_on_cpu()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    # The script ran to its end (an exception leaves above, with its traceback and status 1). Leave without Python's
    # teardown, which races gloo: FSDP2's device mesh outlives the script and holds the gloo group, whose worker
    # threads outlive `destroy_process_group`. A worker that frees an all-gather's work after finalization began must
    # take the GIL to release its output tensors; the thread exits mid-unwind and the rank aborts ("terminate called
    # without an active exception"; core dump: ProcessGroupGloo::runLoop -> ~AsyncAllgatherCoalescedWork ->
    # decref_pyobject -> take_gil -> PyThread_exit_thread). 2 runs in 56 under load: benchmarks/RESULTS.md, which also
    # lists what this skips (atexit handlers, finalizers): in-process clean-up only, nothing the run writes.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
