"""How the model tells the optimizer what a parameter is, without importing the optimizer.

Attributes on `nn.Parameter` (as Megatron marks `tensor_model_parallel`):
- `head_blocks`: a 2-D attention projection made of per-head blocks, which Per-Head Muon
  orthogonalises one by one;
- `adamw_only`: a matrix that must not get Muon (embedding, output head, AttnRes queries).
3-D parameters are stacks of expert matrices `[experts, out, in]`, one Muon matrix each.
"""

from dataclasses import dataclass
from typing import Protocol, cast

import torch


@dataclass(frozen=True)
class HeadBlocks:
    """The weight `[out, in]` is `num_heads` equal blocks along `dim` (0: rows, 1: columns)."""

    dim: int
    num_heads: int


class _HeadBlocksMarked(Protocol):
    head_blocks: HeadBlocks


class _AdamWOnlyMarked(Protocol):
    adamw_only: bool


def mark_head_blocks(param: torch.Tensor, dim: int, num_heads: int) -> None:
    if param.shape[dim] % num_heads:
        raise ValueError(f"dimension {dim} of shape {tuple(param.shape)} does not split into {num_heads} heads")
    cast(_HeadBlocksMarked, param).head_blocks = HeadBlocks(dim, num_heads)  # an attribute torch does not declare


def mark_adamw_only(param: torch.Tensor) -> None:
    cast(_AdamWOnlyMarked, param).adamw_only = True


def linear_weight(linear: torch.nn.Module) -> torch.nn.Parameter:
    """The `weight [out, in]` parameter of a linear factory's module (`nn.Linear` or a TE linear,
    `k3train/kernels/te.py`): typed as such, for modules the factories return as `nn.Module`."""
    weight = linear.weight
    assert isinstance(weight, torch.nn.Parameter), f"{type(linear).__name__}.weight is not a parameter"
    return weight


def head_blocks_of(param: torch.Tensor) -> HeadBlocks | None:
    return getattr(param, "head_blocks", None)


def is_adamw_only(param: torch.Tensor) -> bool:
    return bool(getattr(param, "adamw_only", False))
