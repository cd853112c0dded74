"""The K3 model: embedding → decoder layers → output AttnRes → final norm → head.

Read top to bottom with `decoder.py` (one layer), `attn_res.py` (one sublayer's update) and
`k3train/contracts/stage_io.py` (the residual state and when a block closes). `K3ModelChunk` is the
whole model, or a slice `[start, end)` of its layers with the embedding only on the first slice
and the head only on the last: a pipeline stage runs `forward_layers` on the
`ResidualState(partial, blocks)` it receives. Layers keep their global index in parameter names
(`layers.5.…`), so checkpoints do not depend on how the layers were split.
"""

from __future__ import annotations

import contextlib
import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from k3train.contracts.param_roles import mark_adamw_only
from k3train.contracts.stage_io import ResidualState
from k3train.kernels.precision import upcast
from k3train.model.attn_res import AttentionResidual, KeyedResidualState, source_keys
from k3train.model.config import ModelConfig
from k3train.model.decoder import DecoderLayer
from k3train.model.initialization import TILE_ELEMENTS, TiledStream, draw_local, normal_fill, uniform_fill
from k3train.model.kda import KimiDeltaAttention
from k3train.model.mla import GatedMLA
from k3train.model.moe import LatentMoE
from k3train.model.norm import RMSNorm
from k3train.parallel.context import ContextParallel
from k3train.parallel.expert_exchange import Phases, alternate
from k3train.parallel.tensor import (
    ShardedParameter,
    TensorParallel,
    VocabParallelEmbedding,
    install_sharded_state_dict,
    vocab_parallel_cross_entropy,
)


class K3ModelChunk(nn.Module):
    """Layers `[start, end)` of the K3 model (a pipeline stage's chunk), with the embedding on the
    first chunk and the head on the last; with no `layer_range`, the whole model in one module."""

    def __init__(
        self,
        config: ModelConfig,
        layer_range: tuple[int, int] | None = None,
        parallel=None,
        expert_parallel=None,
        seed: int = 0,
        linear_factory=None,
    ):
        """`parallel`: a `k3train.parallel.state.ParallelState`, or None for one process;
        `expert_parallel`: a `k3train.parallel.expert.ExpertParallel` (this rank's experts only), or None;
        `seed`: the weights are drawn from it and each parameter's name (`init_weights`);
        `linear_factory`: how dense projections are built (`kernels.te`: torch, the default, or
        Transformer Engine; `training.build.build_model` resolves `model.linear_backend`)."""
        super().__init__()
        config.validate()
        self.config = config
        self.tp = tp = (
            TensorParallel(parallel.tp, parallel.sequence_parallel, linear_factory, parallel.tp_overlap_chunks)
            if parallel is not None
            else TensorParallel.single(linear_factory)
        )
        start, end = layer_range if layer_range is not None else (0, config.num_hidden_layers)
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ValueError(f"layer_range {layer_range} must satisfy 0 <= start < end <= {config.num_hidden_layers}")
        self.layer_range = (start, end)
        self.with_embedding = start == 0
        self.with_head = end == config.num_hidden_layers

        if self.with_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
            mark_adamw_only(self.embed_tokens.weight)
        self.layers = nn.ModuleDict(
            {str(index): DecoderLayer(config, index, tp, expert_parallel) for index in range(start, end)}
        )
        if self.with_head:
            self.output_attn_res = (
                AttentionResidual(config.hidden_size, config.rms_norm_eps, recompute=config.recompute != "none")
                if config.attn_res != "none"
                else None
            )
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            if tp.sequence_parallel:
                tp.mark_partial_grad(
                    list(self.norm.parameters())
                    + (list(self.output_attn_res.parameters()) if self.output_attn_res is not None else [])
                )
            # Vocabulary split over TP: each rank holds and computes only its own rows (built as
            # the shard directly: the whole [vocab, hidden] matrix never exists on a rank).
            if config.vocab_size % tp.size:
                raise ValueError(f"vocab_size={config.vocab_size} does not split over tp={tp.size}")
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // tp.size, bias=False)
            tp.mark_sharded(self.lm_head.weight, 0, (config.vocab_size, config.hidden_size))
            if config.tie_word_embeddings and self.with_embedding:
                self.lm_head.weight = self.embed_tokens.weight
            mark_adamw_only(self.lm_head.weight)
        # Context parallelism: this rank holds two pieces of every sequence; the token mixers cross them.
        self.cp = ContextParallel(parallel.cp) if parallel is not None else ContextParallel.single()
        if self.cp.size > 1:
            for module in self.modules():
                if isinstance(module, (KimiDeltaAttention, GatedMLA)):
                    module.context_parallel = self.cp
        self.init_weights(seed)
        install_sharded_state_dict(self)  # checkpoints hold full tensors, loadable under any layout

    # ------------------------------------------------------------------ forward pieces
    def embed(self, input_ids: torch.Tensor) -> ResidualState:
        return ResidualState(partial=self.embed_tokens(input_ids), blocks=[])

    def _decoder_layers(self) -> list[DecoderLayer]:
        """`self.layers` in order, typed: the ModuleDict holds DecoderLayers only."""
        return [cast(DecoderLayer, layer) for layer in self.layers.values()]

    def forward_layers(self, state: ResidualState, document_starts: torch.Tensor | None = None) -> ResidualState:
        layers = self._decoder_layers()
        # The AttnRes mixes of this chunk in order: a block closed before mix k is read by mixes
        # k+1.. (its keys for them are computed once, when it closes).
        mixes = [mix for layer in layers for mix in layer.attn_res_mixes()]
        output_attn_res = getattr(self, "output_attn_res", None)  # only a chunk with the head has one
        if output_attn_res is not None:
            mixes.append(output_attn_res)
        if (
            state.partial is not None
            and state.partial.shape[0] >= 2
            and any(layer.alternates_halves() for layer in layers)
        ):
            # `parallel.ep_overlap_halves`: two halves of the sequences, their layers alternating
            # at every MoE's exchanges (one half's all-to-alls under the other's compute)
            starts = (None, None) if document_starts is None else document_starts.tensor_split(2)
            dispatchers = {id(ep): ep for ep in (moe.expert_parallel for moe in self.moe_layers()) if ep is not None}
            with contextlib.ExitStack() as one_micro_batch:  # the halves' step replicas go home together
                for dispatcher in dispatchers.values():
                    one_micro_batch.enter_context(dispatcher.one_micro_batch())
                halves = alternate(
                    [
                        self._layer_phases(layers, mixes, half, half_starts)
                        for half, half_starts in zip(halves_of(state), starts)
                    ]
                )
            return joined(halves)
        done = 0
        for layer in layers:
            done += len(layer.attn_res_mixes())
            state = layer(state, later=mixes[done:], document_starts=document_starts)
        return state

    @staticmethod
    def _layer_phases(
        layers: list[DecoderLayer],
        mixes: list[AttentionResidual],
        state: ResidualState,
        document_starts: torch.Tensor | None,
    ) -> Phases[ResidualState]:
        """`forward_layers`' loop as a phase generator (yielding where the MoE layers' exchanges do)."""
        done = 0
        for layer in layers:
            done += len(layer.attn_res_mixes())
            state = yield from layer.forward_phases(state, mixes[done:], document_starts)
        return state

    def output_hidden(self, state: ResidualState) -> torch.Tensor:
        """The final aggregation over every block (and the last partial block), then the final norm."""
        if self.output_attn_res is None:
            return self.norm(state.partial)
        return self.output_attn_res.normalized_input(
            state.sources(), self.norm, *source_keys(state, self.output_attn_res)
        )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        state: ResidualState | None = None,
        document_starts: torch.Tensor | None = None,
    ):
        """Logits `[batch, seq, vocab / tp]` on a model with a head (this rank's vocabulary rows,
        every token); otherwise the outgoing `ResidualState`. `document_starts` (`[batch, seq]`
        bool over the whole sequence, also under cp; None: one stream per row): the token
        mixers restart at every True, so each packed document sees only itself."""
        if state is None:
            assert input_ids is not None, "K3ModelChunk.forward needs input_ids or a state"
            state = self.embed(self.cp.shard_sequence(input_ids))  # this rank's pieces under cp
        state = self.forward_layers(state, document_starts)
        if not self.with_head:
            return state
        return self.lm_head(self.tp.enter(self.output_hidden(state)))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy (vocabulary-parallel under TP), fp32 or wider. Under
        context parallelism, over this rank's pieces of `labels` (the whole sequences): every cp
        rank holds as many tokens, so the mean over dp × cp of these means is the global mean.

        `loss_mask` (`[batch, seq]`, the whole sequences; `data.eod_mask_loss`): tokens where it
        is False add nothing; the sum over the kept tokens is divided by all the tokens, so every
        rank's mean keeps the same weight and the mean over ranks is still the global one."""
        labels = self.cp.shard_sequence(labels)
        if loss_mask is None and self.tp.size == 1:
            return lm_loss(logits, labels)
        if self.tp.size == 1:
            per_token = F.cross_entropy(
                upcast(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
            )
        else:
            vocab_start = self.tp.rank * logits.shape[-1]
            per_token = vocab_parallel_cross_entropy(logits, labels, vocab_start, self.tp.group).reshape(-1)
        if loss_mask is None:
            return per_token.mean()
        keep = self.cp.shard_sequence(loss_mask).reshape(-1).to(device=per_token.device, dtype=per_token.dtype)
        return (per_token * keep).sum() / per_token.numel()

    # ------------------------------------------------------------------ MoE hooks
    def moe_layers(self) -> list[LatentMoE]:
        return [layer.block_sparse_moe for layer in self._decoder_layers() if layer.is_moe]

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
    def init_weights(self, seed: int, tile_elements: int = TILE_ELEMENTS) -> None:
        """Initialise every parameter from `(seed, its name)` alone.

        The same parameter gets the same values however the model is sliced into stages, sharded
        or spread over expert ranks, so any layout starts from exactly the single-process weights.
        Each rank draws only the tiles of at most `tile_elements` values that overlap its shard
        (`initialization.TiledStream`), never a whole unsharded tensor.
        """
        gates = {
            f"{name}.{suffix}"
            for name, module in self.named_modules()
            if isinstance(module, KimiDeltaAttention)
            for suffix in ("A_log", "dt_bias")
        }
        for name, param in self.named_parameters():
            if param.is_meta or name in gates:
                continue
            if name.endswith("_res.proj.weight"):
                param.zero_()  # AttnRes queries start at zero: a uniform average over the sources
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.fill_(1.0)
            elif name.split(".")[-1] in ("w1", "w2", "w3"):  # expert e: stream (seed, name.e), on any EP rank
                first = getattr(param, "expert_offset", 0)
                fill = normal_fill(self.config.init_std)
                for local_index in range(param.shape[0]):
                    stream = TiledStream(
                        seed, f"{name}.{first + local_index}", tuple(param.shape[1:]), fill, tile_elements
                    )
                    stream.draw_into(param[local_index])
            else:
                fill = (
                    uniform_fill(1.0 / math.sqrt(param.shape[-1]))
                    if name.endswith("conv1d.weight")
                    else normal_fill(self.config.init_std)
                )
                sharded = getattr(param, "tensor_parallel", False)  # a TP shard of `full_shape`
                stream = TiledStream(seed, name, tuple(getattr(param, "full_shape", param.shape)), fill, tile_elements)
                draw_local(
                    stream,
                    param,
                    self.tp.rank,
                    self.tp.size,
                    cast(ShardedParameter, param).partition_dim if sharded else None,
                )
        for name, module in self.named_modules():
            if isinstance(module, KimiDeltaAttention):
                module.reset_gate_parameters(seed, name, tile_elements)


def halves_of(state: ResidualState) -> list[ResidualState]:
    """`state` as two states of the first and the last half of its sequences (batch rows; the
    first half takes the odd one), with their block keys where `state` has them (flat over the
    tokens: split at the same sequence)."""
    assert state.partial is not None
    rows = state.partial.shape[0]
    first_rows = (rows + 1) // 2

    def halves(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        per_row = tensor.shape[0] // rows  # 1 for [batch, ...] tensors, the tokens of a row for flat ones
        return tensor.tensor_split([first_rows * per_row])

    blocks = [halves(block) for block in state.blocks]
    partial = halves(state.partial)
    keys = getattr(state, "block_keys", [])
    out: list[ResidualState] = []
    for half in range(2):
        half_keys = [
            None
            if entry is None
            else (entry[0], halves(entry[1])[half], {mix: halves(dot)[half] for mix, dot in entry[2].items()})
            for entry in keys
        ]
        out.append(KeyedResidualState(partial[half], [block[half] for block in blocks], half_keys))
    return out


def joined(states: list[ResidualState]) -> ResidualState:
    """The halves of `halves_of` (after the layers) as one state again, block keys included."""
    first, second = states

    def cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        return None if a is None or b is None else torch.cat([a, b])

    keys: list = []  # entries as `KeyedResidualState.block_keys` holds them (None: not computed)
    for entry_a, entry_b in zip(getattr(first, "block_keys", []), getattr(second, "block_keys", [])):
        if entry_a is None or entry_b is None:
            keys.append(None)
        else:
            keys.append(
                (entry_a[0], cat(entry_a[1], entry_b[1]), {m: cat(d, entry_b[2][m]) for m, d in entry_a[2].items()})
            )
    blocks = [torch.cat([a, b]) for a, b in zip(first.blocks, second.blocks)]
    return KeyedResidualState(cat(first.partial, second.partial), blocks, keys)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32."""
    return F.cross_entropy(upcast(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1))


class K3RankModel(nn.Module):
    """This rank's model chunks (one per virtual pipeline stage) as one module with the names of
    the whole model: `layers.<global index>`, and `embed_tokens` / `norm` / `lm_head` where this
    rank holds them. The gradient reducer, the optimizer and checkpoints see one set of names
    whatever the pipeline layout, so a checkpoint saved under one layout loads under another.
    The chunks keep running the forward passes; this module only owns the same submodules.
    """

    def __init__(self, chunks: list[K3ModelChunk]):
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
