"""fla-core's KDA kernels (the CUDA path of `chunk_kda` and `chunk_kda_from_raw`) run under
Triton's CPU interpreter (`TRITON_INTERPRET=1`) against k3train's PyTorch path: outputs, final
states and every gradient, in fp32, T padded to whole chunks, with an initial state; for the raw
inputs, both gates (fla's `safe_gate` for K3's bounded one) with the gradients of `A_log` and
`dt_bias`. This is what holds our calling convention (layouts, scale, log-space gates, the fp32
state, which step fla fuses) to fla's kernels on a machine without a GPU.

Tolerance: every deviation under 1e-4 of the reference's largest magnitude. Both sides compute in
fp32 with different association orders (fla's tiles against our chunk matmuls; gradients of
`A_log` and `dt_bias` are sums over all tokens); measured ≤ 2e-5. A wrong layout, scale, gate or
missing normalisation gives deviations of order 1.

The worker runs in its own process: the interpreter must be chosen before triton is imported,
and it adapts fla's kernels to the interpreter (tests/unit/fla_interpreter_worker.py). Skipped
where triton or fla-core is not installed (the test set-up installs both).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("fla") is None,
    reason="needs triton and fla-core (pip install triton fla-core)")


@pytest.mark.timeout(900)
def test_fla_kernels_under_the_interpreter_match_the_pytorch_path():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "tests.unit.fla_interpreter_worker"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, result.stderr[-4000:]
    cases = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(cases) == {"plain, T=80 (padded)", "raw inputs, bounded gate (-5)", "raw inputs, unbounded gate"}
    failures = {f"{case}: {name}": deviation for case, deviations in cases.items()
                for name, deviation in deviations.items() if not deviation < TOLERANCE}
    assert not failures, f"fla deviates from the PyTorch path (relative to the largest value): {failures}"
    assert all(len(deviations) >= 8 for deviations in cases.values())
