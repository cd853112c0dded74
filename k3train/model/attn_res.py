"""Attention Residuals: the operator, and how one sublayer updates the residual state.

The state itself (`ResidualState(partial, blocks)`, also the pipeline's stage I/O) and the rule
for when a block closes live in `k3train/contracts/stage_io.py`, shared with `parallel/`.

Wiring per sublayer (docs/design.md §1.3, after the released modelling code): the sublayer's input is the
depth-attention mix over `[*blocks, partial]`; if a block closes here, `partial` joins `blocks`
and the sum restarts; the sublayer's output is added to `partial`. Mixing first and pushing
afterwards attends over the same sources in the same order as the reference, so one rule covers
`block`, `full` and `none` (never mix, never push: `partial` is the plain residual).

When a block closes, its key norm is computed once (`KeyNormedResidualState`) and every later
mix reads it instead of normalising the block again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3train.contracts.param_roles import mark_adamw_only
from k3train.contracts.stage_io import ResidualState
from k3train.kernels.attn_res import attn_res_mix, attn_res_mix_rmsnorm, key_inverse_rms
from k3train.model.norm import RMSNorm


@dataclass
class KeyNormedResidualState(ResidualState):
    """The residual state with each block's inverse key norm `(eps, r)`, computed once when the
    block closes and read by every later mix (the key norm's backward then runs once per block,
    not once per mix). Not stage I/O: a state rebuilt from received blocks has no entries, and a
    mix computes the missing norms itself. `block_key_norms[i]` belongs to `blocks[i]`."""

    block_key_norms: list = field(default_factory=list)


def source_key_norms(state: ResidualState, eps: float) -> list[Optional[torch.Tensor]]:
    """For each of `state.sources()`, its cached inverse key norm for `eps`, or None."""
    cached = getattr(state, "block_key_norms", [])
    norms = [cached[i][1] if i < len(cached) and cached[i] is not None and cached[i][0] == eps else None
             for i in range(len(state.blocks))]
    return norms + ([None] if state.partial is not None else [])


class AttentionResidual(nn.Module):
    """One `(query, key-norm)` pair: mixes the sources of one sublayer (or of the output).

    The effective query is `norm.weight ⊙ proj.weight`, two tensors as in the Hugging Face
    checkpoint. `proj` is zero-initialised, so every sublayer starts as a uniform average.
    """

    def __init__(self, hidden_size: int, eps: float, recompute: bool):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.proj = nn.Linear(hidden_size, 1, bias=False)
        nn.init.zeros_(self.proj.weight)
        mark_adamw_only(self.proj.weight)
        self.recompute = recompute

    def normalized_input(self, sources: list[torch.Tensor], norm: nn.Module,
                         inverse_norms: Optional[list[Optional[torch.Tensor]]] = None) -> torch.Tensor:
        """`norm(mix(sources))`: the input of the sublayer's first projection. `inverse_norms`:
        the sources' key norms where computed once already (`source_key_norms`)."""
        if len(sources) == 1:
            return norm(sources[0])  # softmax over one source is exactly 1
        if self.recompute and torch.is_grad_enabled() and isinstance(norm, RMSNorm):
            # Mix and norm in one function that saves the sources (block tensors shared by every
            # later layer, and this layer's partial sum) plus what a plain RMSNorm saves (the
            # mixed state and its inverse norm); backward recomputes the scores rather than
            # running the whole mix a second time.
            return attn_res_mix_rmsnorm(sources, self.norm.weight, self.proj.weight, self.norm.eps,
                                        norm.weight, norm.eps, inverse_norms)
        return norm(self.mix(sources, inverse_norms))

    def mix(self, sources: list[torch.Tensor],
            inverse_norms: Optional[list[Optional[torch.Tensor]]] = None) -> torch.Tensor:
        return attn_res_mix(sources, self.norm.weight, self.proj.weight, self.norm.eps, inverse_norms)


def apply_sublayer(
    state: ResidualState,
    attn_res: Optional[AttentionResidual],
    push_block: bool,
    norm: nn.Module,
    sublayer: Callable[[torch.Tensor], torch.Tensor],
    recompute_sublayer: bool = False,
) -> ResidualState:
    """Run one pre-norm sublayer on the residual state (see the module docstring for the rule).

    `recompute_sublayer` checkpoints the whole sublayer (mix, norm and `sublayer`), saving only
    its inputs.
    """
    if attn_res is None:  # plain residual: x = x + f(norm(x))
        def plain(hidden: torch.Tensor) -> torch.Tensor:
            return sublayer(norm(hidden))
        output = (checkpoint(plain, state.partial, use_reentrant=False)
                  if recompute_sublayer and torch.is_grad_enabled() else plain(state.partial))
        return ResidualState(state.partial + output, state.blocks)

    sources = state.sources()
    eps = attn_res.norm.eps
    inverse_norms = source_key_norms(state, eps)
    given = [norm_ for norm_ in inverse_norms if norm_ is not None]

    def run(*inputs: torch.Tensor) -> torch.Tensor:
        supplied = iter(inputs[len(sources):])
        norms = [next(supplied) if norm_ is not None else None for norm_ in inverse_norms]
        return sublayer(attn_res.normalized_input(list(inputs[:len(sources)]), norm, norms))

    if recompute_sublayer and torch.is_grad_enabled():
        output = checkpoint(run, *sources, *given, use_reentrant=False)
    else:
        output = run(*sources, *given)
    blocks, partial = state.blocks, state.partial
    cached = list(getattr(state, "block_key_norms", []))
    if push_block:
        cached = cached + [None] * (len(blocks) - len(cached)) + [(eps, key_inverse_rms(partial, eps))]
        blocks, partial = blocks + [partial], None
    return KeyNormedResidualState(output if partial is None else partial + output, blocks, cached)
