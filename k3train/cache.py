"""Where k3train keeps what it builds or measures once per machine: the embedded corpus
(k3train/data/corpus.py), the CPU matmul peak (k3train/training/throughput.py) and the test
tools' downloads. One variable moves all of them: `K3TRAIN_CACHE_DIR`.

Stdlib only, so the torch-free config and data code can use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "CacheLocation", "cache_dir", "locate_cache"]

CACHE_DIR_ENV = "K3TRAIN_CACHE_DIR"
DEPRECATED_CACHE_ENV = "K3TRAIN_CACHE"
"""The corpus's earlier variable: still read, with a deprecation line, when the new one is unset."""


@dataclass(frozen=True)
class CacheLocation:
    """The cache directory, what chose it, and the line to print when that was the old variable."""

    path: Path
    source: str
    deprecation: str | None = None


def locate_cache(
    configured: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None
) -> CacheLocation:
    """In order: `configured` (e.g. `data.cache_dir`), `$K3TRAIN_CACHE_DIR`, the deprecated
    `$K3TRAIN_CACHE`, `$XDG_CACHE_HOME/k3train`, `~/.cache/k3train`."""
    environ = os.environ if environ is None else environ
    if configured:
        return CacheLocation(Path(configured).expanduser(), "configured")
    if environ.get(CACHE_DIR_ENV):
        return CacheLocation(Path(environ[CACHE_DIR_ENV]).expanduser(), CACHE_DIR_ENV)
    if environ.get(DEPRECATED_CACHE_ENV):
        return CacheLocation(
            Path(environ[DEPRECATED_CACHE_ENV]).expanduser(),
            DEPRECATED_CACHE_ENV,
            f"warning: {DEPRECATED_CACHE_ENV} is deprecated; set {CACHE_DIR_ENV} instead "
            f"(it moves the corpus and the matmul-peak cache alike)",
        )
    if environ.get("XDG_CACHE_HOME"):
        return CacheLocation(Path(environ["XDG_CACHE_HOME"]).expanduser() / "k3train", "XDG_CACHE_HOME")
    return CacheLocation(Path.home() / ".cache" / "k3train", "default")


def cache_dir(configured: str | os.PathLike | None = None) -> Path:
    """`locate_cache(configured).path`."""
    return locate_cache(configured).path
