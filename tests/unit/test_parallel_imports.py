"""Dependency rules of parallel/ that this layout states: the gradient reduction, ZeRO-1 and
expert dispatch modules import nothing from the model, and from the optimizer package only the
global-norm computation (the job builds the optimizer and hands it in)."""

import ast
from pathlib import Path

import pytest

PARALLEL = Path(__file__).resolve().parents[2] / "parallel"


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("name", ["grad_reduce.py", "zero1.py", "expert.py"])
def test_parallel_modules_do_not_build_the_optimizer_or_import_the_model(name):
    modules = imported_modules(PARALLEL / name)
    assert not {m for m in modules if m == "k3train.model" or m.startswith("k3train.model.")}, name
    optim = {m for m in modules if m == "k3train.optim" or m.startswith("k3train.optim.")}
    assert optim <= {"k3train.optim.clip"}, (name, optim)


def test_data_module_is_gone():
    """Gradient reduction and ZeRO-1 live in grad_reduce.py and zero1.py (no shim)."""
    assert not (PARALLEL / "data.py").exists()
