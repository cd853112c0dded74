"""The K3 model: embedding → decoder layers → output AttnRes → final norm → head.

Read top to bottom with `decoder.py` (one layer), `attn_res.py` (one sublayer's update) and
`k3train/contracts/stage_io.py` (the residual state and when a block closes). The model can be built as a slice `[start, end)` of the layers, with the embedding only on the first
slice and the head only on the last: a pipeline stage runs `forward_layers` on the
`ResidualState(partial, blocks)` it receives. Layers keep their global index in parameter names
(`layers.5.…`), so checkpoints do not depend on how the layers were split.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from k3train.kernels.precision import upcast
from k3train.contracts.stage_io import ResidualState
from k3train.model.attn_res import AttentionResidual
from k3train.model.config import ModelConfig
from k3train.model.decoder import DecoderLayer
from k3train.model.kda import initialize_gate_parameters
from k3train.model.moe import LatentMoE
from k3train.model.norm import RMSNorm
from k3train.contracts.param_roles import mark_adamw_only
from k3train.parallel.tensor import (
    TensorParallel,
    VocabParallelEmbedding,
    install_sharded_state_dict,
    vocab_parallel_cross_entropy,
)


class K3Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_range: Optional[tuple[int, int]] = None,
        with_embedding: Optional[bool] = None,
        with_head: Optional[bool] = None,
        parallel=None,
        expert_parallel=None,
    ):
        """`parallel`: a `k3train.parallel.state.ParallelState`, or None for one process;
        `expert_parallel`: a `k3train.parallel.expert.ExpertParallel` (this rank's experts only), or None."""
        super().__init__()
        config.validate()
        self.config = config
        self.tp = tp = (TensorParallel(parallel.tp, parallel.sequence_parallel) if parallel is not None
                        else TensorParallel.single())
        start, end = layer_range if layer_range is not None else (0, config.num_hidden_layers)
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ValueError(f"layer_range {layer_range} must satisfy 0 <= start < end <= {config.num_hidden_layers}")
        self.layer_range = (start, end)
        self.with_embedding = start == 0 if with_embedding is None else with_embedding
        self.with_head = end == config.num_hidden_layers if with_head is None else with_head

        if self.with_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            mark_adamw_only(self.embed_tokens.weight)
        self.layers = nn.ModuleDict({str(index): DecoderLayer(config, index, tp, expert_parallel) for index in range(start, end)})
        if self.with_head:
            self.output_attn_res = (
                AttentionResidual(config.hidden_size, config.rms_norm_eps, recompute=config.recompute != "none")
                if config.attn_res != "none" else None
            )
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            if tp.sequence_parallel:
                tp.mark_partial_grad(list(self.norm.parameters()) + (
                    list(self.output_attn_res.parameters()) if self.output_attn_res is not None else []))
            # Vocabulary split over TP: each rank computes the logits of its own rows.
            self.lm_head = tp.shard_linear(nn.Linear(config.hidden_size, config.vocab_size, bias=False), 0)
            if config.tie_word_embeddings and self.with_embedding:
                self.lm_head.weight = self.embed_tokens.weight
            mark_adamw_only(self.lm_head.weight)
        self.init_weights(seed=0)
        install_sharded_state_dict(self)  # checkpoints hold full tensors, loadable under any layout

    # ------------------------------------------------------------------ forward pieces
    def embed(self, input_ids: torch.Tensor) -> ResidualState:
        return ResidualState(partial=self.embed_tokens(input_ids), blocks=[])

    def forward_layers(self, state: ResidualState) -> ResidualState:
        for layer in self.layers.values():
            state = layer(state)
        return state

    def output_hidden(self, state: ResidualState) -> torch.Tensor:
        """The final aggregation over every block (and the last partial block), then the final norm."""
        if self.output_attn_res is None:
            return self.norm(state.partial)
        return self.output_attn_res.normalized_input(state.sources(), self.norm)

    def forward(self, input_ids: Optional[torch.Tensor] = None, state: Optional[ResidualState] = None):
        """Logits `[batch, seq, vocab / tp]` on a model with a head (this rank's vocabulary rows,
        every token); otherwise the outgoing `ResidualState`."""
        if state is None:
            state = self.embed(input_ids)
        state = self.forward_layers(state)
        if not self.with_head:
            return state
        return self.lm_head(self.tp.enter(self.output_hidden(state)))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (vocabulary-parallel under TP), fp32 or wider."""
        if self.tp.size == 1:
            return lm_loss(logits, labels)
        vocab_start = self.tp.rank * logits.shape[-1]
        return vocab_parallel_cross_entropy(logits, labels, vocab_start, self.tp.group).mean()

    # ------------------------------------------------------------------ MoE hooks
    def moe_layers(self) -> list[LatentMoE]:
        return [layer.block_sparse_moe for layer in self.layers.values() if layer.is_moe]

    def update_routing_biases(self, group=None) -> None:
        """After the optimizer step: every MoE layer replaces its bias for the next step
        (`group`: the ranks whose routing statistics are combined, see `LatentMoE`)."""
        for moe in self.moe_layers():
            moe.update_routing_bias(group)

    def discard_routing_statistics(self) -> None:
        """After a skipped step: forget what the balancers saw, keep the biases."""
        for moe in self.moe_layers():
            moe.balancer.next_bias(moe.gate.e_score_correction_bias.clone())

    # ------------------------------------------------------------------ initialisation
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise every parameter from `(seed, its name)` alone.

        The same parameter gets the same values however the model is sliced into stages, so a
        pipelined or sharded model starts from exactly the single-process weights.
        """
        config = self.config
        for name, param in self.named_parameters():
            if param.is_meta:
                continue
            if name.split(".")[-1] in ("w1", "w2", "w3"):  # expert stacks: one stream per expert
                self._init_experts(name, param, seed)
                continue
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full_shape = getattr(param, "full_shape", tuple(param.shape))  # TP shards: draw the whole tensor
            value = torch.empty(full_shape, dtype=torch.float32)
            if name.endswith("_res.proj.weight"):
                value.zero_()  # AttnRes queries start at zero: a uniform average over the sources
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                value.fill_(1.0)
            elif name.endswith("conv1d.weight"):
                bound = 1.0 / math.sqrt(param.shape[-1])
                value.uniform_(-bound, bound, generator=generator)
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                continue  # initialised together below
            else:
                value.normal_(0.0, config.init_std, generator=generator)
            param.copy_(self._local_part(param, value))
        for name, module in self.named_modules():
            if hasattr(module, "A_log") and not module.A_log.is_meta:
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full_A_log = torch.empty(getattr(module.A_log, "full_shape", module.A_log.shape))
                full_dt_bias = torch.empty(getattr(module.dt_bias, "full_shape", module.dt_bias.shape))
                initialize_gate_parameters(full_A_log, full_dt_bias, module.gate_lower_bound is not None, generator)
                module.A_log.copy_(self._local_part(module.A_log, full_A_log))
                module.dt_bias.copy_(self._local_part(module.dt_bias, full_dt_bias))

    def _init_experts(self, name: str, param: torch.Tensor, seed: int) -> None:
        """Expert `e` of a stack is drawn from `(seed, name, e)`: the same values whichever rank
        holds it, without ever materialising all experts of a layer on one rank."""
        first = getattr(param, "expert_offset", 0)
        for local_index in range(param.shape[0]):
            key = f"{name}.{first + local_index}"
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
            value = torch.empty(param.shape[1:], dtype=torch.float32).normal_(0.0, self.config.init_std, generator=generator)
            param[local_index].copy_(value)

    def _local_part(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        if getattr(param, "tensor_parallel", False):
            return self.tp.local_slice(full, param.partition_dim)
        return full


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32."""
    return F.cross_entropy(upcast(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1))


class K3Stage(nn.Module):
    """This rank's model chunks (one per virtual pipeline stage) as one module with the names of
    the whole model: `layers.<global index>`, and `embed_tokens` / `norm` / `lm_head` where this
    rank holds them. The gradient reducer, the optimizer and checkpoints see one set of names
    whatever the pipeline layout, so a checkpoint saved under one layout loads under another.
    The chunks keep running the forward passes; this module only owns the same submodules.
    """

    def __init__(self, chunks: list[K3Model]):
        super().__init__()
        self.chunks = chunks  # a plain list: the submodules are registered below under global names
        self.layers = nn.ModuleDict()
        for chunk in chunks:
            for index, layer in chunk.layers.items():
                self.layers[index] = layer
        for name in ("embed_tokens", "output_attn_res", "norm", "lm_head"):
            for chunk in chunks:
                if getattr(chunk, name, None) is not None:
                    setattr(self, name, getattr(chunk, name))
        install_sharded_state_dict(self)

    def moe_layers(self) -> list[LatentMoE]:
        return [moe for chunk in self.chunks for moe in chunk.moe_layers()]

    def update_routing_biases(self, group=None) -> None:
        for chunk in self.chunks:
            chunk.update_routing_biases(group)

    def discard_routing_statistics(self) -> None:
        for chunk in self.chunks:
            chunk.discard_routing_statistics()
