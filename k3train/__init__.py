"""k3train: Megatron-style distributed pretraining for the Kimi K3 architecture.

The checkout keeps `parallel/` and `kernels/` beside `k3train/` (the layout Megatron users
expect); `k3train/parallel` and `k3train/kernels` are symbolic links to them, so they import as
`k3train.parallel` and `k3train.kernels` through the ordinary import system, and IDEs and type
checkers resolve them the same way; installed wheels carry both inside `k3train/`. Each file has
one module name: `parallel/__init__.py` refuses the top-level name `parallel`, and `kernels/` has
no `__init__.py` so that a regular package of that name (Hugging Face's `kernels`) always wins
over it. A checkout whose links did not survive (git's `core.symlinks=false` writes them as small
text files) is refused here with one line, rather than letting another installation's k3train
answer the import. Scripts (`pretrain_k3.py`, `tools/*.py`) import the installed package
(`tools/setup_env.sh` installs the checkout in editable mode); a script run from one checkout
while another checkout is installed is refused with one line too, instead of running the other
checkout's code.
"""

import sys
from pathlib import Path

__version__ = "0.1.0"


def _check_sibling_folders() -> None:
    package = Path(__file__).resolve().parent
    for name in ("parallel", "kernels"):
        if not (package / name).is_dir():
            raise ImportError(
                f"{package / name} is not a folder: in a checkout it must be the link to ../{name} "
                f"(git config core.symlinks true, then git checkout -- k3train/{name})"
            )


def _check_script_checkout() -> None:
    """The checkout of the running script (`<checkout>/tools/x.py`, `<checkout>/pretrain_k3.py`,
    `<checkout>/benchmarks/x.py`) must be the one this package was imported from."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    if script is None or not script.is_file():
        return
    here = Path(__file__).resolve().parents[1]
    for candidate in (script.parent, script.parent.parent):
        if (candidate / "k3train" / "__init__.py").is_file() and (candidate / "pyproject.toml").is_file():
            if candidate != here:
                raise ImportError(
                    f"{script} belongs to the checkout {candidate}, but k3train was imported from {here}; "
                    f"install this checkout (bash {candidate / 'tools' / 'setup_env.sh'}) or run the script of {here}"
                )
            return


_check_sibling_folders()
_check_script_checkout()
