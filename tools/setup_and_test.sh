#!/usr/bin/env bash
# Set up a fresh machine, run the lint/format/type checks (tools/lint.sh), then the test suite
# (the README's second command, and what .ci/run runs).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/setup_env.sh
# triton and fla-core for the test that runs fla's KDA kernels under Triton's CPU interpreter
# (tests/unit/test_kda_fla_interpreter.py), in a directory of their own that only that test's
# worker puts on its path: in this Python, k3train and transformers never see them (transformers'
# Kimi Linear takes fla's kernels whenever fla imports, even for CPU tensors where they cannot run).
# They live in k3train's cache (`K3TRAIN_CACHE_DIR`, else ~/.cache/k3train), so clones share them.
cache="${K3TRAIN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/k3train}"
export K3TRAIN_INTERPRETER_PACKAGES="${K3TRAIN_INTERPRETER_PACKAGES:-$cache/triton-interpreter}"
# Optional: without them (no network, no wheel for this platform) that one test skips.
if ! PYTHONPATH="$K3TRAIN_INTERPRETER_PACKAGES" python -c "import triton, fla; assert triton.__version__ == '3.9.0' and fla.__version__ == '0.6.0'" 2>/dev/null; then
    echo "setup_and_test: installing triton 3.9.0 and fla-core 0.6.0 into $K3TRAIN_INTERPRETER_PACKAGES (about 400 MB download, once)" >&2
    # pinned: the test's worker adapts these releases' internals to the interpreter
    if python -m pip install --quiet --upgrade --target "$K3TRAIN_INTERPRETER_PACKAGES" triton==3.9.0 fla-core==0.6.0; then
        # The interpreter compiles nothing: the GPU toolchains triton bundles (ptxas, CUDA and ROCm
        # libraries, about 470 MB) are never run there.
        rm -rf "$K3TRAIN_INTERPRETER_PACKAGES"/triton/backends/nvidia/bin "$K3TRAIN_INTERPRETER_PACKAGES"/triton/backends/nvidia/lib \
            "$K3TRAIN_INTERPRETER_PACKAGES"/triton/backends/amd/lib
    else
        echo "setup_and_test: triton/fla-core not installed; tests/unit/test_kda_fla_interpreter.py will skip" >&2
    fi
fi
bash tools/lint.sh
exec python -m pytest tests "$@"
