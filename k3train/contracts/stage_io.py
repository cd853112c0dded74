"""The residual state that flows between sublayers and across pipeline stages, and the one rule
for when a block representation closes.

The state of the residual stream is `ResidualState(partial, blocks)`: `blocks` are the
completed block representations (the embedding first), `partial` the running sum of the current
block's sublayer outputs (or, with plain residuals, the hidden state). A micro-batch crosses a
stage boundary as `(partial, blocks)`; the receiver keeps the blocks it already has.

A block closes (the running `partial` joins `blocks`) before a sublayer when `closes_block`
says so: `block` before the token mixer of every `attn_res_block_size`-th layer (layer 0 pushes
the embedding), `full` before every sublayer, `none` never. The model's decoder layers, the
pipeline plan and the FLOP census all ask this one function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # annotations only: the block rule is used by the torch-free config checks
    import torch

ATTN_RES_MODES = ("block", "full", "none")
Sublayer = Literal["mixer", "ffn"]
SUBLAYERS: tuple[Sublayer, Sublayer] = ("mixer", "ffn")


@dataclass
class ResidualState:
    """What flows between sublayers and across pipeline stages."""

    partial: torch.Tensor | None
    blocks: list[torch.Tensor] = field(default_factory=list)

    def sources(self) -> list[torch.Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])


def closes_block(attn_res: str, block_size: int, layer: int, sublayer: Sublayer) -> bool:
    """Whether the running partial sum becomes a block representation just before `sublayer`
    (`"mixer"` or `"ffn"`) of decoder layer `layer`."""
    if attn_res not in ATTN_RES_MODES:
        raise ValueError(f"unknown model.attn_res {attn_res!r}; expected one of {', '.join(ATTN_RES_MODES)}")
    if sublayer not in SUBLAYERS:
        raise ValueError(f"unknown sublayer {sublayer!r}; expected one of {SUBLAYERS}")
    if attn_res == "full":
        return True
    return attn_res == "block" and sublayer == "mixer" and layer % block_size == 0


def blocks_before_layer(attn_res: str, block_size: int, layer: int) -> int:
    """Block representations in the residual state at the input of decoder layer `layer`
    (`layer = L`: after the last one): the closes of every sublayer below it."""
    if attn_res not in ATTN_RES_MODES:  # checked even when no layer lies below `layer`
        raise ValueError(f"unknown model.attn_res {attn_res!r}; expected one of {', '.join(ATTN_RES_MODES)}")
    return sum(closes_block(attn_res, block_size, below, sublayer) for below in range(layer) for sublayer in SUBLAYERS)
