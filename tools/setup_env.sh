# Sourced by the README's commands: install what k3train needs into the current Python.
#
# Everything runs in a subshell, so the caller's shell keeps its options (no `set -e` left behind
# in an interactive terminal) and its environment; the file's status is the subshell's, so a
# caller running under `set -e` (tools/setup_and_test.sh) still stops on a failed install.
# Threads are not set here: the job chooses its own count (k3train/training/threads.py).
#
# torch, when it is not importable yet: on a machine where `nvidia-smi -L` lists a GPU, the
# default (CUDA) build from PyPI; otherwise the CPU build, first as the local wheel
# (torch==2.13.0+cpu from pip's configured find-links or indexes), else the newest CPU build from
# PyTorch's CPU index (never PyPI's torch, which is the multi-GB CUDA build).
(
    set -euo pipefail
    if ! python -c "import torch" 2>/dev/null; then
        if nvidia-smi -L >/dev/null 2>&1; then
            python -m pip install --quiet torch
        else
            python -m pip install --quiet "torch==2.13.0+cpu" \
                || python -m pip install --quiet torch --index-url https://download.pytorch.org/whl/cpu
        fi
    fi
    python -m pip install --quiet numpy pyyaml tqdm safetensors tokenizers pytest pytest-timeout transformers matplotlib
)
