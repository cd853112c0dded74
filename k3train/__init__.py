"""k3train: Megatron-style distributed pretraining for the Kimi K3 architecture.

The checkout keeps `parallel/` and `kernels/` beside `k3train/` (the layout Megatron users
expect), but they are imported as `k3train.parallel` and `k3train.kernels`. Installed wheels
carry them there physically (see pyproject.toml); from a checkout they are mounted below. Either
way nothing named `kernels` or `parallel` reaches the top level of `sys.modules`, so the Hugging
Face `kernels` package (used by `transformers`) is never shadowed.
"""

import importlib.machinery
import importlib.util
import pathlib
import sys

__version__ = "0.1.0"

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
_CHECKOUT_DIR = _PACKAGE_DIR.parent


def _mount_sibling_package(name: str) -> None:
    """Import `<checkout>/<name>/` as `k3train.<name>` when running from a checkout.

    The sibling directories deliberately have no `__init__.py`: Python prefers a regular package
    found anywhere on `sys.path` over such a directory, so a checkout on `sys.path` (which running
    `python pretrain_k3.py` always puts there) cannot shadow Hugging Face's top-level `kernels`.
    """
    qualified = f"{__name__}.{name}"
    if qualified in sys.modules or (_PACKAGE_DIR / name).is_dir():
        return  # already imported, or an installed wheel that carries it inside k3train/
    spec = importlib.machinery.ModuleSpec(qualified, None, is_package=True)
    spec.submodule_search_locations = [str(_CHECKOUT_DIR / name)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    setattr(sys.modules[__name__], name, module)


for _sibling in ("kernels", "parallel"):
    _mount_sibling_package(_sibling)
