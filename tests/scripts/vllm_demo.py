"""The CPU demo (`examples/grpo_fp8.py --config recipes/demo_cpu.yaml`) sampled by colocated vLLM instead of the
reference engine: on a GPU as is; on vLLM's CPU build with the block-FP8 kernels stood in for as in
tests/scripts/vllm_two_steps.py. Extra arguments go to the example (e.g. `--max_steps 10`).

    .venv-vllm-cpu/bin/python tests/scripts/vllm_demo.py --output_dir outputs/grpo-fp8-demo-vllm
"""

import os
import runpy
import sys
from pathlib import Path

import torch
from vllm_two_steps import _emulate_vllm_fp8_kernels_on_cpu


ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    if not torch.cuda.is_available():
        _emulate_vllm_fp8_kernels_on_cpu()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.chdir(ROOT)
    sys.argv = [
        "examples/grpo_fp8.py", "--config", "recipes/demo_cpu.yaml", "--use_vllm", "true",
        "--vllm_llm_kwargs", '{"enforce_eager": true}', *sys.argv[1:],
    ]  # fmt: skip
    runpy.run_path("examples/grpo_fp8.py", run_name="__main__")
