"""`kernels/` and `parallel/` live under the k3train namespace: Hugging Face's top-level `kernels`
package stays importable beside k3train (DESIGN.md's naming hazard)."""

import os
import pathlib
import subprocess
import sys

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]


def test_huggingface_kernels_package_is_not_shadowed(tmp_path):
    fake_site = tmp_path / "site"
    (fake_site / "kernels").mkdir(parents=True)
    (fake_site / "kernels" / "__init__.py").write_text("FROM_HUGGING_FACE = True\n")
    code = (
        "import sys, k3train, k3train.kernels.kda, k3train.parallel.state\n"
        "assert 'parallel' not in sys.modules\n"
        "import kernels\n"
        "assert kernels.FROM_HUGGING_FACE\n"
        "assert k3train.kernels.__name__ == 'k3train.kernels'\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHECKOUT), str(fake_site)]))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
