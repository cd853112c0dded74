"""Package names that load their submodule on first use (PEP 562).

`k3train.data`, `k3train.optim`, `k3train.checkpoint` and `k3train.config` export names from submodules that
import torch, while their `config` submodules must stay importable without it (the recipe loader
and `pretrain_k3.py --help` answer before torch loads). Each package lists `name -> submodule`
and installs the two hooks made here; static tools see the names through an
`if TYPE_CHECKING:` import block in the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, submodule_of: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`: a listed name is read from its submodule."""

    def __getattr__(name: str) -> Any:
        if name not in submodule_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(submodule_of[name]), name)

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *submodule_of})

    return __getattr__, __dir__
