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


def test_sibling_folders_resolve_statically_under_k3train():
    """`k3train.kernels`/`k3train.parallel` are plain folders under k3train/ (links to the
    checkout's top-level folders), so static tools find them without running k3train/__init__."""
    for name in ("kernels", "parallel"):
        inside = CHECKOUT / "k3train" / name
        assert inside.is_dir(), f"k3train/{name} is missing"
        assert inside.resolve() == (CHECKOUT / name).resolve()
        assert not (CHECKOUT / name / "__init__.py").exists(), f"{name}/__init__.py would shadow a top-level package"
    init = (CHECKOUT / "k3train" / "__init__.py").read_text()
    assert "sys.modules[" not in init, "k3train/__init__.py must not mount packages at run time"
