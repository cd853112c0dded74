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
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_sibling_folders_resolve_statically_under_k3train():
    """`k3train.kernels`/`k3train.parallel` are plain folders under k3train/ (links to the
    checkout's top-level folders), so static tools find them without running k3train/__init__."""
    for name in ("kernels", "parallel"):
        inside = CHECKOUT / "k3train" / name
        assert inside.is_dir(), f"k3train/{name} is missing"
        assert inside.resolve() == (CHECKOUT / name).resolve()
    assert not (CHECKOUT / "kernels" / "__init__.py").exists(), (
        "kernels/__init__.py would shadow Hugging Face's kernels"
    )
    init = (CHECKOUT / "k3train" / "__init__.py").read_text()
    assert "sys.modules[" not in init, "k3train/__init__.py must not mount packages at run time"


def test_each_file_has_one_module_name(tmp_path):
    """`parallel.state` (the folder reached from the checkout as a top-level name) is refused with
    one line naming the right import; `k3train.parallel.state` is the only name."""
    code = "import parallel.state"
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: import k3train.parallel, not parallel: parallel/ is part of the k3train package"
    )


def test_a_checkout_without_its_links_is_refused_in_one_line(tmp_path):
    """git with core.symlinks=false writes each link as a text file holding its target: importing
    k3train says so and how to fix it, instead of finding k3train.parallel somewhere else."""
    copy = tmp_path / "checkout"
    (copy / "k3train").mkdir(parents=True)
    (copy / "k3train" / "__init__.py").write_text((CHECKOUT / "k3train" / "__init__.py").read_text())
    (copy / "k3train" / "parallel").write_text("../parallel")
    (copy / "k3train" / "kernels").write_text("../kernels")
    env = dict(os.environ, PYTHONPATH=str(copy))
    result = subprocess.run(
        [sys.executable, "-c", "import k3train"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ") and "k3train/parallel is not a folder" in last and "core.symlinks" in last


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a source file imports, at any depth (lazy imports in functions included)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_parallel_does_not_import_the_model():
    """`parallel/` shares only the contracts (`k3train.contracts`) with the model, never imports it."""
    sources = sorted((CHECKOUT / "parallel").rglob("*.py"))
    assert sources
    offenders = {
        str(path.relative_to(CHECKOUT)): sorted(
            name for name in _imported_modules(path) if name == "k3train.model" or name.startswith("k3train.model.")
        )
        for path in sources
    }
    assert not {path: names for path, names in offenders.items() if names}


def test_pretrain_script_imports_torch_only_after_parsing():
    """`pretrain_k3.py --help` and recipe errors must not wait for torch: the script's module-level
    imports are the standard library and the config parser."""
    import ast

    tree = ast.parse((CHECKOUT / "pretrain_k3.py").read_text())
    top_level: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top_level.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            top_level.add(node.module)
    assert "torch" not in top_level
    torch_free = {
        "k3train.config",
        "k3train.config.command_line",  # test_config checks they stay torch-free
        "k3train.job.signals",
        "k3train.errors",
        "k3train.job.ending",
        "k3train.job.preflight",
        "k3train.job.run_lock",
    }
    assert not any(name.startswith("k3train.") and name not in torch_free for name in top_level), top_level
