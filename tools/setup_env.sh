# Sourced by the README's commands: install what k3train needs into the current Python.
# The CPU build of torch goes in first on machines without a GPU, so that no requirement pulls
# a multi-GB CUDA build.
set -euo pipefail
if ! python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        python -m pip install --quiet torch
    else
        python -m pip install --quiet torch==2.13.0 || python -m pip install --quiet torch --index-url https://download.pytorch.org/whl/cpu
    fi
fi
python -m pip install --quiet numpy pyyaml tqdm safetensors tokenizers pytest pytest-timeout
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
