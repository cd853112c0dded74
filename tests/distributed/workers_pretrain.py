"""Worker side of the end-to-end parallel training checks: every rank runs `pretrain_k3.main`."""

from __future__ import annotations

import importlib.util
import pathlib

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]


def run_pretrain(env, argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("pretrain_k3", CHECKOUT / "pretrain_k3.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.main(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
