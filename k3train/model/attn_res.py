"""Attention Residuals: the operator, and how one sublayer updates the residual state.

The state itself (`ResidualState(partial, blocks)`, also the pipeline's stage I/O) and the rule
for when a block closes live in `k3train/contracts/stage_io.py`, shared with `parallel/`.

Wiring per sublayer (docs/design.md §1.3, after the released modelling code): the sublayer's input is the
depth-attention mix over `[*blocks, partial]`; if a block closes here, `partial` joins `blocks`
and the sum restarts; the sublayer's output is added to `partial`. Mixing first and pushing
afterwards attends over the same sources in the same order as the reference, so one rule covers
`block`, `full` and `none` (never mix, never push: `partial` is the plain residual).

When a block closes, its keys are computed once (`KeyedResidualState`): its key norm, and its dot
with the score weight of every later mix in the model chunk, which those mixes read instead of
normalising and scoring the block again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from k3train.contracts.param_roles import mark_adamw_only
from k3train.contracts.stage_io import ResidualState
from k3train.kernels.attn_res import attn_res_mix, attn_res_mix_rmsnorm, block_keys
from k3train.model.norm import RMSNorm
from k3train.parallel.expert_exchange import Phases, run_phases


@dataclass
class KeyedResidualState(ResidualState):
    """The residual state with each block's keys, computed once when the block closes (the
    two-phase form: the scores against completed blocks need not be recomputed per mix):
    `block_keys[i] = (eps, r, dots)` for `blocks[i]`, with `r` its inverse key norm and `dots`
    `{id(mix): (γ ⊙ w)ᵀ v}` for every later mix of this model chunk. Not stage I/O: a state rebuilt
    from received blocks has no entries, and a mix computes what is missing itself."""

    block_keys: list = field(default_factory=list)


def torch_checkpoint(function: Callable, *inputs: torch.Tensor) -> torch.Tensor:
    """torch's non-reentrant activation checkpoint of `function(*inputs)`."""
    return checkpoint(function, *inputs, use_reentrant=False)


def source_keys(state: ResidualState, attn_res: AttentionResidual) -> tuple[list, list]:
    """For each of `state.sources()`, `attn_res`'s cached inverse key norm and dot, or None."""
    entries = getattr(state, "block_keys", [])
    eps, norms, dots = attn_res.norm.eps, [], []
    for i in range(len(state.blocks)):
        entry = entries[i] if i < len(entries) else None
        norms.append(entry[1] if entry is not None and entry[0] == eps else None)
        dots.append(entry[2].get(id(attn_res)) if entry is not None else None)
    if state.partial is not None:
        norms.append(None)
        dots.append(None)
    return norms, dots


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
        # `train.compile=true` (k3train/training/compile.py) sets a compiled `norm(mix(sources))`
        # of the plain formula here (it reads the block keys too).
        self.compiled_mix_norm: Callable | None = None

    def normalized_input(
        self,
        sources: list[torch.Tensor],
        norm: nn.Module,
        inverse_norms: list[torch.Tensor | None] | None = None,
        dots: list[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """`norm(mix(sources))`: the input of the sublayer's first projection. `inverse_norms`,
        `dots`: the sources' keys where computed once already (`source_keys`)."""
        if len(sources) == 1:
            return norm(sources[0])  # softmax over one source is exactly 1
        if self.compiled_mix_norm is not None and isinstance(norm, RMSNorm):
            return self.compiled_mix_norm(
                sources, self.norm.weight, self.proj.weight, self.norm.eps, norm.weight, norm.eps, inverse_norms, dots
            )
        if self.recompute and torch.is_grad_enabled() and isinstance(norm, RMSNorm):
            # Mix and norm in one function that saves the sources (block tensors shared by every
            # later layer, and this layer's partial sum) plus what a plain RMSNorm saves (the
            # mixed state and its inverse norm); backward recomputes the scores rather than
            # running the whole mix a second time.
            return attn_res_mix_rmsnorm(
                sources, self.norm.weight, self.proj.weight, self.norm.eps, norm.weight, norm.eps, inverse_norms, dots
            )
        return norm(self.mix(sources, inverse_norms, dots))

    def mix(
        self,
        sources: list[torch.Tensor],
        inverse_norms: list[torch.Tensor | None] | None = None,
        dots: list[torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        return attn_res_mix(sources, self.norm.weight, self.proj.weight, self.norm.eps, inverse_norms, dots)


def apply_sublayer(
    state: ResidualState,
    attn_res: AttentionResidual | None,
    push_block: bool,
    norm: nn.Module,
    sublayer: Callable[[torch.Tensor], torch.Tensor],
    recompute_sublayer: bool = False,
    later: Sequence[AttentionResidual] = (),
    checkpoint_function: Callable | None = None,
) -> ResidualState:
    """Run one pre-norm sublayer on the residual state (see the module docstring for the rule).

    `recompute_sublayer` checkpoints the whole sublayer (mix, norm and `sublayer`), saving only
    its inputs, through `checkpoint_function(function, *inputs)` (None: torch's non-reentrant
    checkpoint; Transformer Engine's under TE linears, `kernels.te.fp8_checkpoint`). `later`: the mixes after this one in the model chunk, which read a block closed
    here; its keys for them are computed once, when it closes.
    """
    return run_phases(
        sublayer_phases(
            state, attn_res, push_block, norm, at_once(sublayer), recompute_sublayer, later, checkpoint_function
        )
    )


def at_once(function: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], Phases[torch.Tensor]]:
    """`function` as a phase generator that never yields."""

    def phases(x: torch.Tensor) -> Phases[torch.Tensor]:
        return function(x)
        yield  # a generator function: never reached

    return phases


def sublayer_phases(
    state: ResidualState,
    attn_res: AttentionResidual | None,
    push_block: bool,
    norm: nn.Module,
    sublayer: Callable[[torch.Tensor], Phases[torch.Tensor]],
    recompute_sublayer: bool = False,
    later: Sequence[AttentionResidual] = (),
    checkpoint_function: Callable | None = None,
) -> Phases[ResidualState]:
    """`apply_sublayer` with a sublayer written as a phase generator (`LatentMoE.forward_phases`):
    it yields where the sublayer does, so that the caller runs other work there
    (`parallel.ep_overlap_halves`). A recomputed sublayer runs to its end inside the checkpoint."""
    recompute = checkpoint_function or torch_checkpoint
    checkpointed = recompute_sublayer and torch.is_grad_enabled()
    if attn_res is None:  # plain residual: x = x + f(norm(x))
        assert state.partial is not None  # with plain residuals `partial` is the hidden state

        def plain(hidden: torch.Tensor) -> Phases[torch.Tensor]:
            return (yield from sublayer(norm(hidden)))

        if checkpointed:
            output = recompute(lambda hidden: run_phases(plain(hidden)), state.partial)
        else:
            output = yield from plain(state.partial)
        return ResidualState(state.partial + output, state.blocks)

    sources = state.sources()
    inverse_norms, dots = source_keys(state, attn_res)
    given = [t for t in inverse_norms + dots if t is not None]

    def run(*inputs: torch.Tensor) -> Phases[torch.Tensor]:
        supplied = iter(inputs[len(sources) :])
        norms_in = [next(supplied) if t is not None else None for t in inverse_norms]
        dots_in = [next(supplied) if t is not None else None for t in dots]
        return (yield from sublayer(attn_res.normalized_input(list(inputs[: len(sources)]), norm, norms_in, dots_in)))

    if checkpointed:
        output = recompute(lambda *inputs: run_phases(run(*inputs)), *sources, *given)
    else:
        output = yield from run(*sources, *given)
    blocks, partial = state.blocks, state.partial
    keys = list(getattr(state, "block_keys", []))
    if push_block:
        assert partial is not None  # a block closes over a running partial sum (the embedding first)
        eps = attn_res.norm.eps
        inverse_norm, block_dots = block_keys(partial, eps, [(mix.norm.weight, mix.proj.weight) for mix in later])
        keys = (
            keys
            + [None] * (len(blocks) - len(keys))
            + [(eps, inverse_norm, {id(mix): dot for mix, dot in zip(later, block_dots)})]
        )
        blocks, partial = blocks + [partial], None
    return KeyedResidualState(output if partial is None else partial + output, blocks, keys)
