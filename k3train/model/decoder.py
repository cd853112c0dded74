"""One decoder layer: AttnRes → norm → token mixer (KDA or Gated MLA), AttnRes → norm → FFN.

With `recompute: attn_res` (the default) each AttnRes mix is checkpointed together with the norm
that follows it; with `recompute: sublayer` each whole sublayer is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from k3train.contracts.stage_io import ResidualState, closes_block
from k3train.model.attn_res import AttentionResidual, apply_sublayer, at_once, sublayer_phases
from k3train.model.config import ModelConfig
from k3train.model.kda import KimiDeltaAttention
from k3train.model.mla import GatedMLA
from k3train.model.mlp import GLUMLP
from k3train.model.moe import LatentMoE
from k3train.model.norm import RMSNorm
from k3train.parallel.expert_exchange import Phases, run_phases
from k3train.parallel.tensor import TensorParallel


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, tensor_parallel: TensorParallel | None = None, expert_parallel=None
    ):
        super().__init__()
        tp = tensor_parallel or TensorParallel.single()
        self.layer_index = layer_index
        self.attn_res_mode = config.attn_res
        self.block_size = config.attn_res_block_size
        self.recompute_sublayers = config.recompute == "sublayer"
        # TE linears recompute through TE's checkpoint (the FP8 region re-entered); None: torch's
        self.checkpoint_function = getattr(tp.linear_factory, "checkpoint", None)
        self.is_mla = config.is_mla_layer(layer_index)
        self.is_moe = config.is_moe_layer(layer_index)

        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GatedMLA(config, tp) if self.is_mla else KimiDeltaAttention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(config, tp, expert_parallel)
        else:
            self.mlp = GLUMLP(config, config.hidden_size, config.intermediate_size, tp)
        if config.attn_res != "none":
            recompute_mix = config.recompute != "none"
            self.self_attention_res: AttentionResidual | None = AttentionResidual(
                config.hidden_size, config.rms_norm_eps, recompute_mix
            )
            self.mlp_res: AttentionResidual | None = AttentionResidual(
                config.hidden_size, config.rms_norm_eps, recompute_mix
            )
        else:
            self.self_attention_res = self.mlp_res = None
        if tp.sequence_parallel:  # norms and AttnRes see only this rank's tokens
            outside_regions = [
                self.input_layernorm,
                self.post_attention_layernorm,
                self.self_attention_res,
                self.mlp_res,
            ]
            tp.mark_partial_grad([p for module in outside_regions if module is not None for p in module.parameters()])

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if self.is_moe else self.mlp

    def alternates_halves(self) -> bool:
        """Whether this layer's MoE yields to the micro-batch's other half while its exchanges are
        on the wire (`parallel.ep_overlap_halves`)."""
        ep = self.block_sparse_moe.expert_parallel if self.is_moe else None
        return ep is not None and ep.overlap_halves

    def pushes_block_before_mixer(self) -> bool:
        """Whether the running partial sum becomes a block representation before the token mixer."""
        return closes_block(self.attn_res_mode, self.block_size, self.layer_index, "mixer")

    def pushes_block_before_ffn(self) -> bool:
        return closes_block(self.attn_res_mode, self.block_size, self.layer_index, "ffn")

    def attn_res_mixes(self) -> list[AttentionResidual]:
        """This layer's AttnRes mixes in order (none with plain residuals)."""
        return [
            mix
            for mix in (getattr(self, "self_attention_res", None), getattr(self, "mlp_res", None))
            if mix is not None
        ]

    def forward(
        self,
        state: ResidualState,
        later: Sequence[AttentionResidual] = (),
        document_starts: torch.Tensor | None = None,
    ) -> ResidualState:
        """`later`: the AttnRes mixes after this layer's in the model chunk (they read the blocks
        this layer closes; their keys are computed once, at the close). `document_starts`
        (`[batch, seq]` bool, or None): the token mixer keeps packed documents apart."""
        return run_phases(self.forward_phases(state, later, document_starts))

    def forward_phases(
        self,
        state: ResidualState,
        later: Sequence[AttentionResidual] = (),
        document_starts: torch.Tensor | None = None,
    ) -> Phases[ResidualState]:
        """`forward` as a phase generator: it yields where the MoE's exchanges are on the wire
        (`LatentMoE.forward_phases`), so that the model runs the micro-batch's other half there."""
        after_mixer = self.attn_res_mixes()[1:] + list(later)
        # bound here, not set on the module: a recomputed forward must see this micro-batch's documents
        mixer = (
            self.self_attn
            if document_starts is None
            else functools.partial(self.self_attn, document_starts=document_starts)
        )
        state = apply_sublayer(
            state,
            self.self_attention_res,
            self.pushes_block_before_mixer(),
            self.input_layernorm,
            mixer,
            self.recompute_sublayers,
            after_mixer,
            self.checkpoint_function,
        )
        # the module call (and its hooks) unless the MoE's exchanges may leave room for the other half
        ffn = self.block_sparse_moe.forward_phases if self.alternates_halves() else at_once(self.ffn)
        return (
            yield from sublayer_phases(
                state,
                self.mlp_res,
                self.pushes_block_before_ffn(),
                self.post_attention_layernorm,
                ffn,
                self.recompute_sublayers,
                later,
                self.checkpoint_function,
            )
        )
