#!/usr/bin/env bash
# Every GPU test and benchmark of trl-fp8 in one call, for a machine with PyTorch and Triton (TE and vLLM tests skip
# cleanly when those are missing): about 8 minutes on one H200, at most 9 (the timeouts below keep it under the
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
# What RESULTS.md records with the figures: date, commit, command, hardware, driver and software versions.
{
  echo "date: $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (modified)')"
  echo "command: bash benchmarks/gpu_checks.sh $out $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
  python3 -c "
import platform, importlib.metadata as md, torch
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')
for p in ('triton', 'transformers', 'numpy', 'transformer-engine', 'pytest-xdist'):
    try:
        print(p, md.version(p))
    except md.PackageNotFoundError:
        print(p, 'not installed')
"
} | tee "$out/env.txt"
# (tests/test_blockwise.py is left to CPU CI: it tests the reference alone, and its property tests need hypothesis,
# which the device lacked when this was written; a test file that cannot be collected fails alone, not the run.)
# Four pytest workers where pytest-xdist is installed (the device lists it): the tests' time is mostly Triton compiling
# and autotuning, on the CPU. Each test line is kept (-v) and failures get short tracebacks, so a run cut short by
# the timeout still says which tests failed and why; pytest-timeout (where installed) ends a test after 120 s.
opts=(-v --tb=short -rfE --durations=15)
python3 -c "import pytest_timeout" 2>/dev/null && opts+=(--timeout=120 --timeout-method=thread)
python3 -c "import xdist" 2>/dev/null && opts+=(-n 4 --dist loadgroup)
# The files in the order xdist hands their tests out: the default `torch` path's linears and siblings first (they
# run the autotuned quantizers), then each quantizer config and the Triton GEMM, so that a run cut short by the
# timeout (as on 2026-12-04, inside test_triton_kernels.py, then first) has checked what `backend="auto"` trains with.
timeout 220 python3 -m pytest -p no:cacheprovider --continue-on-collection-errors "${opts[@]}" \
  tests/test_linear.py tests/test_linear_state.py tests/test_torch_backend.py tests/test_siblings.py \
  tests/test_triton_kernels.py tests/test_triton_gemm.py tests/test_moe_grouped.py tests/test_te_backend.py \
  2>&1 | tee "$out/pytest.log" | grep -E "FAILED|ERROR|XPASS|passed|failed|Timeout" | tail -40
tests=${PIPESTATUS[0]}
timeout 310 python3 benchmarks/gpu_bench.py --output_dir "$out" --budget_s 250 "$@" 2>&1 | tee "$out/bench.log" | tail -80
bench=${PIPESTATUS[0]}
echo "gpu_checks: pytest exit $tests, gpu_bench exit $bench (124: timed out)" | tee -a "$out/env.txt"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
