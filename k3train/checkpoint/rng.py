"""RNG state of a process (`capture_rng_state`/`restore_rng_state`) and the per-rank wrappers that
save it (`RNGState`) or any other rank-specific state (`PerRank`) under rank-specific keys."""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

from k3train.checkpoint.process_group import global_rank
from k3train.checkpoint.state import is_stateful


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG streams: torch CPU, CUDA (every device, if CUDA is initialised), Python
    `random` and numpy's global generator (if numpy is installed).

    The torch states are uint8 tensors (saved as tensors); the Python and numpy states are
    tuples (saved as JSON, `values.py`).
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    else:
        state["numpy"] = np.random.get_state()
    return state


def _is_uint8_state(value: Any, like: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and tuple(value.shape) == tuple(like.shape)


def rng_state_problem(state: Any) -> str | None:
    """What makes `state` not a state `capture_rng_state` wrote (None: it is one). Checked before
    any stream is set, so a damaged state changes nothing: torch's and CUDA's are uint8 tensors
    of this torch's size, Python's is (version, 625 words, gauss), numpy's is MT19937's tuple."""
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a mapping of streams"
    unknown = sorted(set(state) - {"torch", "cuda", "python", "numpy"})
    if unknown:
        return f"unknown streams {unknown}"
    if "torch" in state and not _is_uint8_state(state["torch"], torch.get_rng_state()):
        return "the torch stream is not a uint8 tensor of torch's generator size"
    if "cuda" in state:
        cuda = state["cuda"]
        ok = isinstance(cuda, list | tuple) and all(
            isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.dim() == 1 for s in cuda
        )
        if not ok:
            return "the cuda streams are not a list of uint8 tensors"
    if "python" in state:
        py = state["python"]
        words = py[1] if isinstance(py, list | tuple) and len(py) == 3 else None
        ok = (
            isinstance(words, list | tuple)
            and py[0] == random.getstate()[0]
            and len(words) == len(random.getstate()[1])
            and all(isinstance(w, int) and 0 <= w < 2**32 for w in words)
            and (py[2] is None or isinstance(py[2], float))
        )
        if not ok:
            return "the python stream is not (version, 625 words, gauss) of random.getstate()"
    if "numpy" in state:
        import numpy as np

        np_state = state["numpy"]
        ok = (
            isinstance(np_state, list | tuple)
            and len(np_state) == 5
            and np_state[0] == "MT19937"
            and isinstance(np_state[1], np.ndarray)
            and np_state[1].shape == (624,)
            and np.issubdtype(np_state[1].dtype, np.integer)
            and isinstance(np_state[2], int | np.integer)
            and 0 <= int(np_state[2]) <= 624
        )
        if not ok:
            return "the numpy stream is not MT19937's (name, 624 words, position, has_gauss, gauss)"
    return None


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the RNG streams captured by `capture_rng_state` (streams absent from `state` are left).
    Raises ValueError, setting nothing, for a state `capture_rng_state` could not have written."""
    problem = rng_state_problem(state)
    if problem is not None:
        raise ValueError(f"not an RNG state: {problem}")
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    if "python" in state:
        py = state["python"]
        # A saved tuple comes back as a tuple; be lenient with a list-ified state.
        if isinstance(py, list):
            py = (py[0], tuple(py[1]), py[2])
        random.setstate(py)
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        saved = [torch.as_tensor(s, dtype=torch.uint8).cpu() for s in state["cuda"]]
        count = torch.cuda.device_count()
        if len(saved) != count:
            warnings.warn(
                f"checkpoint holds CUDA RNG states for {len(saved)} devices, this process sees "
                f"{count}; restoring the first {min(len(saved), count)}",
                stacklevel=2,
            )
        for device, s in enumerate(saved[:count]):
            torch.cuda.set_rng_state(s, device)


class PerRank:
    """Save `obj` (a dict or an object with `state_dict`/`load_state_dict`) under this process's
    global rank: `<app_state key>.rank_<r>.*`, so ranks whose values differ do not collide (DCP
    keeps one copy of a key that several ranks save). Loading reads only this rank's entry; a rank
    the checkpoint has no entry for keeps its current state and warns."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    @staticmethod
    def rank_key(rank: int | None = None) -> str:
        return f"rank_{global_rank() if rank is None else rank}"

    def state_dict(self) -> dict[str, Any]:
        inner = self.obj.state_dict() if is_stateful(self.obj) else self.obj
        return {self.rank_key(): inner}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = self.rank_key()
        if key not in state_dict:
            warnings.warn(
                f"checkpoint has no {type(self.obj).__name__} state for {key} (it holds "
                f"{sorted(state_dict) or 'none'}); keeping this rank's current state",
                stacklevel=2,
            )
            return
        value = state_dict[key]
        if is_stateful(self.obj):
            self.obj.load_state_dict(value)
        elif isinstance(self.obj, dict):
            self.obj.clear()
            self.obj.update(value)
        else:
            self.obj = value


class _ProcessRNG:
    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_rng_state(state_dict)


class RNGState(PerRank):
    """Put `RNGState()` into `app_state` to save and restore every rank's RNG streams."""

    def __init__(self) -> None:
        super().__init__(_ProcessRNG())
