# Sourced by the README's commands: install what k3train needs, then leave its Python on PATH.
#
# The Python: an active virtual environment is used as it is. Without one, `python` is used when
# it exists, is 3.11+ and accepts installs; where it is missing or refuses them (PEP 668: Debian's
# and Ubuntu's system Python), the checkout's `.venv` is created (once, from `python3`) and
# activated in the caller's shell, so the `python` of the next command is that one
# (`K3TRAIN_VENV` names another directory for it).
#
# The installs run in a subshell, so the caller's shell keeps its options (no `set -e` left behind
# in an interactive terminal) and its environment; the file's status is the last step's, so a
# caller running under `set -e` (tools/setup_and_test.sh) still stops on a failed step.
# Threads are not set here: the job chooses its own count (k3train/training/threads.py).
#
# torch, when it is not importable yet: on a machine where `nvidia-smi -L` lists a GPU, the
# default (CUDA) build from PyPI; otherwise the CPU build, first as the local wheel
# (torch==2.13.0+cpu from pip's configured find-links or indexes), else the newest CPU build from
# PyTorch's CPU index (never PyPI's torch, which is the multi-GB CUDA build). The other packages
# are installed only when one is missing or transformers is not the version the tests were
# written against, so a second run takes a second.
__k3train_venv="$(
    set -euo pipefail
    here="${BASH_SOURCE[0]}"
    case "$here" in */*) here="${here%/*}" ;; *) here=. ;; esac
    checkout="$(cd "$here/.." && pwd)"
    venv="${K3TRAIN_VENV:-$checkout/.venv}"
    # 0: usable as is; 3: refuses installs (PEP 668); 4: older than 3.11. "python-check" marks the probe.
    probe='import os, sys, sysconfig  # python-check
if sys.version_info < (3, 11): sys.exit(4)
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(3 if managed and sys.prefix == sys.base_prefix else 0)'
    if [ -n "${VIRTUAL_ENV:-}" ] && command -v python >/dev/null 2>&1; then
        exit 0
    fi
    status=0
    if command -v python >/dev/null 2>&1; then
        python -c "$probe" || status=$?
        if [ "$status" -eq 0 ]; then exit 0; fi
        if [ "$status" -eq 4 ]; then
            echo "setup_env: python is $(python -V 2>&1); k3train needs Python 3.11+ (activate one, then source this again)" >&2
            exit 1
        elif [ "$status" -ne 3 ]; then
            echo "setup_env: '$(command -v python)' does not run (status $status)" >&2
            exit 1
        fi
    fi
    if [ ! -x "$venv/bin/python" ]; then
        if ! command -v python3 >/dev/null 2>&1; then
            echo "setup_env: no python or python3 on PATH; install Python 3.11+ (Debian: apt-get install python3 python3-venv)" >&2
            exit 1
        fi
        status=0
        python3 -c "$probe" || status=$?
        if [ "$status" -eq 4 ]; then
            echo "setup_env: python3 is $(python3 -V 2>&1); k3train needs Python 3.11+" >&2
            exit 1
        fi
        echo "setup_env: creating the virtual environment $venv (this Python refuses pip installs or has no 'python')" >&2
        python3 -m venv "$venv" >&2 || {
            echo "setup_env: could not create $venv; install the venv module (Debian: apt-get install python3-venv) and source this again" >&2
            exit 1
        }
    fi
    echo "$venv"
)" && { [ -z "$__k3train_venv" ] || . "$__k3train_venv/bin/activate"; } && (
    set -euo pipefail
    if ! python -c "import torch" 2>/dev/null; then
        if nvidia-smi -L >/dev/null 2>&1; then
            echo "setup_env: installing torch (CUDA build, a few GB; minutes)" >&2
            python -m pip install --quiet torch
        else
            echo "setup_env: installing torch (CPU build, about 200 MB; a minute or two)" >&2
            python -m pip install --quiet "torch==2.13.0+cpu" \
                || python -m pip install --quiet torch --index-url https://download.pytorch.org/whl/cpu
        fi
    fi
    # k3train itself, editable (the checkout is the source), so the scripts in tools/ and
    # benchmarks/ import it from any directory; re-pointed when another checkout held the name.
    checkout="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if ! (cd / && python -c "import sys, k3train; sys.exit(k3train.__file__ != sys.argv[1])" "$checkout/k3train/__init__.py") 2>/dev/null; then
        echo "setup_env: installing k3train from $checkout (editable)" >&2
        python -m pip install --quiet --no-deps --no-build-isolation -e "$checkout"
    fi
    # transformers is pinned: the HF tests compare against its Kimi Linear and loading code.
    if ! python -c "import numpy, yaml, tqdm, safetensors, tokenizers, pytest, pytest_timeout, matplotlib, transformers
assert transformers.__version__ == '5.23.0'" 2>/dev/null; then
        echo "setup_env: installing numpy, pyyaml, tqdm, safetensors, tokenizers, pytest, pytest-timeout, transformers 5.23.0, matplotlib" >&2
        python -m pip install --quiet numpy pyyaml tqdm safetensors tokenizers pytest pytest-timeout \
            "transformers==5.23.0" matplotlib
    fi
)
# The file's status is the steps' (a caller under `set -e` stops on a failed one); no variable is left behind.
__k3train_status=$?
eval "unset __k3train_venv __k3train_status; (exit $__k3train_status)"
