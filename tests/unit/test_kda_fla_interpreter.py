"""fla-core's KDA kernels (the CUDA path of `chunk_kda` and `chunk_kda_from_raw`) run under
Triton's CPU interpreter (`TRITON_INTERPRET=1`) against k3train's PyTorch path: outputs, final
states and every gradient, in fp32, T padded to whole chunks, with an initial state; for the raw
inputs, both gates (K3's bounded one also through fla's `safe_gate`) with the gradients of `A_log` and
`dt_bias`; fla's causal convolution with SiLU (the q/k/v short convolutions on CUDA) against
`short_conv_silu`'s PyTorch path; both over variable-length segments (`cu_seqlens`, packed
documents) against the varlen PyTorch paths; and fla's fused gated RMSNorm (KDA's output norm on CUDA)
against `gated_rms_norm`'s. This is what holds our calling convention (layouts, scale, log-space gates, the fp32
state, which step fla fuses) to fla's kernels on a machine without a GPU.

Tolerance: every deviation under 1e-4 of the reference's largest magnitude. Both sides compute in
fp32 with different association orders (fla's tiles against our chunk matmuls; gradients of
`A_log` and `dt_bias` are sums over all tokens); measured ≤ 2e-5. A wrong layout, scale, gate or
missing normalisation gives deviations of order 1.

The worker runs in its own process: the interpreter must be chosen before triton is imported,
it adapts fla's kernels to the interpreter (tests/unit/fla_interpreter_worker.py), and it finds
triton and fla-core in a directory of their own (`tools/setup_and_test.sh` installs them into
`triton-interpreter` of k3train's cache directory; `K3TRAIN_INTERPRETER_PACKAGES` names another), which nothing else
in the suite sees: transformers' Kimi Linear would take fla's kernels for CPU tensors. Skipped
where neither that directory nor this Python has both.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3train.cache import cache_dir

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = Path(os.environ.get("K3TRAIN_INTERPRETER_PACKAGES") or cache_dir() / "triton-interpreter")
TOLERANCE = 1e-4


def _installed(name: str) -> bool:
    return (PACKAGES / name).is_dir() or importlib.util.find_spec(name) is not None


pytestmark = pytest.mark.skipif(
    not (_installed("triton") and _installed("fla")),
    reason=f"needs triton and fla-core: pip install --target {PACKAGES} triton fla-core (tools/setup_and_test.sh does)",
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fla_kernels_under_the_interpreter_match_the_pytorch_path():
    path = os.pathsep.join(p for p in (str(PACKAGES), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": path,
    }
    result = subprocess.run(
        [sys.executable, "-m", "tests.unit.fla_interpreter_worker"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    cases = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(cases) == {
        "plain, T=80 (padded)",
        "raw inputs, bounded gate (-5)",
        "raw inputs, unbounded gate",
        "raw inputs, bounded gate, safe_gate",
        "short conv + SiLU, T=37",
        "gated RMSNorm",
        "varlen KDA (4 segments)",
        "varlen short conv + SiLU (4 segments)",
    }
    failures = {
        f"{case}: {name}": deviation
        for case, deviations in cases.items()
        for name, deviation in deviations.items()
        if not deviation < TOLERANCE
    }
    assert not failures, f"fla deviates from the PyTorch path (relative to the largest value): {failures}"
    assert all(len(deviations) >= 3 for deviations in cases.values())
