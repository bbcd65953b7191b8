#!/usr/bin/env bash
# Every GPU test and benchmark of trl-fp8 in one call, for a machine with PyTorch and Triton (TE and vLLM tests skip
# cleanly when those are missing): about 5 minutes on one H200, at most 9.5 (the timeouts below keep it under the
# device's 10-minute cap per call; Triton's first compiles and autotuning are most of the tests' time). Results land
# in OUT_DIR:
#   env.txt, pytest.log, bench.log, gpu_bench.json, gpu_bench.md, profile_<backend>.json.gz (a Perfetto trace),
#   gpu_targets.png (where matplotlib is installed; else `python benchmarks/bench_report.py OUT_DIR` draws it)
#
#   bash benchmarks/gpu_checks.sh OUT_DIR [gpu_bench.py options, e.g. --smoke to check the script on a CPU]
#
# Run from the repository root; trl-fp8 need not be installed (PYTHONPATH), nor TRL (the numerics do not import it).
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_checks.sh OUT_DIR [gpu_bench.py options]}
shift
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" | tee "$out/env.txt"
# (tests/test_blockwise.py is left to CPU CI: it tests the reference alone, and its property tests need hypothesis,
# which the device lacked when this was written; a test file that cannot be collected fails alone, not the run.)
# The warp-specialized TMA GEMM configs are the only kernels no GPU has run yet: should one hang, pytest-timeout (where
# installed) ends pytest after 120 s on one test instead of 250 s, and gpu_bench then runs without them.
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120 --timeout-method=thread)
timeout 250 python3 -m pytest -q -p no:cacheprovider -rs --durations=10 --continue-on-collection-errors "${per_test[@]}" \
  tests/test_triton_kernels.py tests/test_moe_grouped.py tests/test_linear.py tests/test_torch_backend.py \
  tests/test_siblings.py tests/test_te_backend.py \
  2>&1 | tee "$out/pytest.log" | tail -30
tests=${PIPESTATUS[0]}
if [ "$tests" = 124 ] || grep -q "Timeout +" "$out/pytest.log"; then
  export TRL_FP8_TRITON_TMA=0
  echo "gpu_checks: pytest hung (exit $tests); gpu_bench runs without the TMA configs (TRL_FP8_TRITON_TMA=0)" \
    | tee -a "$out/env.txt"
fi
timeout 310 python3 benchmarks/gpu_bench.py --output_dir "$out" --budget_s 250 "$@" 2>&1 | tee "$out/bench.log" | tail -80
bench=${PIPESTATUS[0]}
echo "gpu_checks: pytest exit $tests, gpu_bench exit $bench (124: timed out)" | tee -a "$out/env.txt"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
