"""Kimi Delta Attention mixer (docs/design.md §1.1): projections, short convolutions, gates → kernels.kda.

Per head, the delta rule with a channel-wise decay: `S_t = (I − β k kᵀ) Diag(α_t) S_{t−1} + β k vᵀ`,
`o_t = S_tᵀ q_t`. The model side builds the inputs of that recurrence; the kernels compute it.
A `KDACache` (recurrent state plus the short convolutions' last inputs) can be passed in and
returned, so a sequence can be processed in pieces (inference, context parallelism).

With `document_starts` (`[batch, seq]` bool over the whole sequence, True where a packed
document begins) the recurrent state and the convolutions' tails start afresh at every
document: each document runs as a sequence of its own (`kernels.kda.varlen`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from k3train.contracts.param_roles import linear_weight, mark_adamw_only, mark_head_blocks
from k3train.kernels.kda.raw_inputs import chunk_kda_from_raw, prepare_kda_inputs
from k3train.kernels.kda.varlen import chunk_kda_varlen
from k3train.kernels.norms import gated_rms_norm
from k3train.kernels.segments import segment_offsets
from k3train.kernels.short_conv import short_conv_silu, short_conv_silu_varlen
from k3train.model.config import ModelConfig
from k3train.model.initialization import TILE_ELEMENTS, TiledStream, TileFill, draw_local
from k3train.parallel.context import ContextParallel
from k3train.parallel.tensor import TensorParallel


@dataclass
class KDACache:
    """What a KDA layer carries from one piece of a sequence to the next."""

    recurrent_state: torch.Tensor  # [batch, heads, head_dim, head_dim], fp32
    conv_tails: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v: [batch, channels, kernel - 1]


def gate_fill(a_log_draws: int) -> TileFill:
    """The decay gate's initial stream: `a_log_draws` values of `A_log` (the full tensor's, 0 for
    the bounded gate), then every `dt_bias` value. K3 starts A at 0 with the bounded gate (no draw);
    Kimi Linear draws A from log U(1, 16). `dt_bias` is Mamba's: dt log-uniform in [1e-3, 1e-1],
    stored as softplus⁻¹(dt)."""

    def fill(values: torch.Tensor, generator: torch.Generator, first_row: int) -> None:
        split = min(max(a_log_draws - first_row, 0), values.shape[0])
        values[:split].uniform_(1, 16, generator=generator).log_()
        dt = values[split:].uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp_()
        dt.add_(torch.log(-torch.expm1(-dt)))

    return fill


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution (no bias) followed by SiLU; weight `[channels, 1, kernel]`
    (`kernels.short_conv`: channels last, no transposes)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        mark_adamw_only(self.weight)  # 3-D but not a stack of matrices: C filters of 4 taps
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [batch, seq, channels]`, `tail [batch, channels, kernel - 1]` (zeros if None) →
        (output `[batch, seq, channels]`, the last `kernel - 1` inputs for the next piece)."""
        return short_conv_silu(x, self.weight, tail)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the attention output times `sigmoid(gate)`, in fp32; weight `[head_dim]`."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class KimiDeltaAttention(nn.Module):
    """Heads split over tensor-parallel ranks: projections, short convolutions and gates are
    sharded per channel; the low-rank gate inputs `f_a` (and `g_a`) and the output norm are replicated."""

    def __init__(self, config: ModelConfig, tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.tp = tp = tensor_parallel or TensorParallel.single()
        lac = config.linear_attn_config
        self.num_heads, self.head_dim = lac.num_heads // tp.size, lac.head_dim  # heads on this rank
        self.gate_lower_bound = lac.gate_lower_bound
        self.chunk_size = lac.chunk_size
        self.context_parallel: ContextParallel | None = None  # set by K3ModelChunk when cp > 1
        # A sublayer recomputed in backward keeps its leave unfused (TensorParallel.leave_projection).
        self.fuse_leave = config.recompute != "sublayer"
        hidden, heads, width = config.hidden_size, lac.num_heads, lac.num_heads * lac.head_dim
        local_width = width // tp.size

        def column(in_features: int, out_features: int, per_head: bool = True) -> nn.Module:
            linear = tp.linear(in_features, out_features)
            if per_head:
                mark_head_blocks(linear_weight(linear), 0, heads)
            return tp.shard_linear(linear, partition_dim=0)

        self.q_proj, self.k_proj, self.v_proj = (column(hidden, width) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            ShortConvolution(local_width, lac.short_conv_kernel_size) for _ in range(3)
        )
        # Decay gate: low-rank input f_b(f_a(x)) + dt_bias, per-head A_log.
        self.f_a_proj = tp.linear(hidden, config.kda_gate_rank)
        self.f_b_proj = column(config.kda_gate_rank, width, per_head=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(local_width))
        self.b_proj = column(hidden, heads, per_head=False)
        # Output: per-head RMSNorm gated by sigmoid(g(x)): full-rank g_proj (K3) or low-rank
        # g_b_proj(g_a_proj(x)) (Kimi Linear).
        output_rank = config.kda_output_gate_rank
        if output_rank is None:
            self.g_proj = column(hidden, width)
        else:
            self.g_a_proj = tp.linear(hidden, output_rank)
            self.g_b_proj = column(output_rank, width, per_head=False)
        self.o_norm = GatedRMSNorm(lac.head_dim, config.rms_norm_eps)
        o_proj = tp.linear(width, hidden)
        mark_head_blocks(linear_weight(o_proj), 1, heads)
        self.o_proj = tp.shard_linear(o_proj, partition_dim=1)

        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            tp.mark_sharded(conv.weight, 0, (width, 1, lac.short_conv_kernel_size))
        tp.mark_sharded(self.A_log, 0, (heads,))
        tp.mark_sharded(self.dt_bias, 0, (width,))
        replicated = [linear_weight(self.f_a_proj), self.o_norm.weight]
        if output_rank is not None:
            replicated.append(linear_weight(self.g_a_proj))
        tp.mark_partial_grad(replicated)
        self.reset_gate_parameters(seed=0, key="")  # K3ModelChunk.init_weights redraws it from its name

    @torch.no_grad()
    def reset_gate_parameters(self, seed: int, key: str, tile_elements: int = TILE_ELEMENTS) -> None:
        """Draw this rank's `A_log` and `dt_bias` from the gate's stream `(seed, key)` (see
        `gate_fill`): the one place the gate is initialised, the same values under any TP size."""
        if self.A_log.is_meta:
            return
        heads = self.A_log.shape[0] * self.tp.size
        a_log_draws = 0 if self.gate_lower_bound is not None else heads
        stream = TiledStream(
            seed, key, (a_log_draws + self.dt_bias.shape[0] * self.tp.size,), gate_fill(a_log_draws), tile_elements
        )
        if a_log_draws:
            draw_local(stream, self.A_log, self.tp.rank, self.tp.size, 0)
        else:
            self.A_log.zero_()
        draw_local(stream, self.dt_bias, self.tp.rank, self.tp.size, 0, first_row=a_log_draws)

    def forward(self, x: torch.Tensor, document_starts: torch.Tensor | None = None) -> torch.Tensor:
        if document_starts is not None:
            return self.forward_documents(x, document_starts)
        return self.forward_with_cache(x, None, return_cache=False)[0]

    def forward_documents(self, x: torch.Tensor, document_starts: torch.Tensor) -> torch.Tensor:
        """The layer over packed documents: state and convolution tails reset where
        `document_starts` (`[batch, seq]`, the whole sequence) is True."""
        cp = self.context_parallel if self.context_parallel is not None and self.context_parallel.size > 1 else None
        q_in, k_in, v_in, f_a, beta_logits, gate = self._project(x, cp)
        starts = document_starts.to(device=q_in.device, dtype=torch.bool)
        if cp is not None:  # each local piece runs as a sequence of its own, with its documents
            tail_mask = cp.tail_mask(starts, self.q_conv1d.kernel_size - 1)
            starts = cp.split_pieces(cp.shard_sequence(starts))
        batch, seq, _ = q_in.shape
        heads, head_dim = self.num_heads, self.head_dim
        cu_seqlens = segment_offsets(starts)
        tails: tuple[torch.Tensor | None, ...] = (None, None, None)
        if cp is not None:  # a piece's first document continues from the piece before, unless it starts there
            width = self.q_conv1d.kernel_size - 1
            piece_tails = cp.previous_tails(torch.cat([q_in, k_in, v_in], dim=-1), width) * tail_mask
            first = torch.searchsorted(cu_seqlens, torch.arange(batch, device=q_in.device) * seq)
            every = piece_tails.new_zeros(len(cu_seqlens) - 1, *piece_tails.shape[1:])
            tails = every.index_copy(0, first, piece_tails).split(q_in.shape[-1], dim=1)

        def flat(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(1, batch * seq, *t.shape[2:])

        q, k, v = (
            short_conv_silu_varlen(flat(t), conv.weight, cu_seqlens, tail)
            for t, conv, tail in zip((q_in, k_in, v_in), (self.q_conv1d, self.k_conv1d, self.v_conv1d), tails)
        )
        q, k, v = (t.view(batch, seq, heads, head_dim) for t in (q, k, v))
        gate_input = self.f_b_proj(f_a).view(batch, seq, heads, head_dim)
        q, k, g, beta = prepare_kda_inputs(
            q, k, gate_input, beta_logits, self.A_log, self.dt_bias, self.gate_lower_bound
        )
        if cp is not None:
            output = cp.chunk_kda(q, k, v, g, beta, chunk_size=self.chunk_size, piece_starts=starts)
        else:
            output = chunk_kda_varlen(
                flat(q), flat(k), flat(v), flat(g), flat(beta), cu_seqlens, chunk_size=self.chunk_size
            )[0].view(batch, seq, heads, -1)
        return self._output(gate, output, cp)

    def _project(self, x: torch.Tensor, cp: ContextParallel | None) -> tuple[torch.Tensor, ...]:
        """The region's entry and every projection of its input: `(q, k, v, f_a, β logits, output
        gate or its low-rank a-part)`, each split into the context-parallel pieces when `cp`
        is given. `TensorParallel.enter_projections` overlaps the entry's collectives with these
        GEMMs when the layout asks for it (`parallel.tp_overlap_chunks`)."""
        gate_proj = self.g_proj if hasattr(self, "g_proj") else self.g_a_proj
        projections = [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, gate_proj]
        _, outputs = self.tp.enter_projections(x, projections)
        if cp is not None:  # each local piece of the sequence runs as a sequence of its own
            outputs = [cp.split_pieces(t) for t in outputs]
        return tuple(outputs)

    def _output(self, gate: torch.Tensor, output: torch.Tensor, cp: ContextParallel | None) -> torch.Tensor:
        """The gated norm and `o_proj` of the kernel's output `[batch, seq, heads, head_dim]`;
        `gate`: the output gate's projection (the a-part when it is low-rank)."""
        batch, seq = output.shape[:2]
        heads, head_dim = self.num_heads, self.head_dim
        if not hasattr(self, "g_proj"):
            gate = self.g_b_proj(gate)
        output = self.o_norm(output, gate.view(batch, seq, heads, head_dim)).reshape(batch, seq, heads * head_dim)
        if cp is not None:  # (before o_proj, which acts on each token alone)
            output = cp.merge_pieces(output)
        return self.tp.leave_projection(output, self.o_proj, self.fuse_leave)

    def forward_with_cache(
        self, x: torch.Tensor, cache: KDACache | None, return_cache: bool = True
    ) -> tuple[torch.Tensor, KDACache | None]:
        cp = self.context_parallel if self.context_parallel is not None and self.context_parallel.size > 1 else None
        if cp is not None and (cache is not None or return_cache):
            raise ValueError("a KDA cache cannot be combined with context parallelism")
        # (with context parallelism each local piece of the sequence runs as a sequence of its own)
        q_in, k_in, v_in, f_a, beta_logits, gate_projection = self._project(x, cp)
        batch, seq, _ = q_in.shape
        heads, head_dim = self.num_heads, self.head_dim
        tails = cache.conv_tails if cache is not None else (None, None, None)
        if cp is not None:  # the convolutions' tails come from the pieces before
            width = self.q_conv1d.kernel_size - 1
            tails = cp.previous_tails(torch.cat([q_in, k_in, v_in], dim=-1), width).split(q_in.shape[-1], dim=1)
        q, q_tail = self.q_conv1d(q_in, tails[0])
        k, k_tail = self.k_conv1d(k_in, tails[1])
        v, v_tail = self.v_conv1d(v_in, tails[2])
        q, k, v = (t.view(batch, seq, heads, head_dim) for t in (q, k, v))
        gate_input = self.f_b_proj(f_a).view(batch, seq, heads, head_dim)
        # q and k are L2-normalised, the gate applied and β = sigmoid(logits) next to the kernel
        # (`chunk_kda_from_raw`): on CUDA with fla-core, inside its kernel.
        gate = (self.A_log, self.dt_bias, self.gate_lower_bound)
        if cp is not None:  # the recurrent state crosses the pieces (parallel/context.py)
            q, k, g, beta = prepare_kda_inputs(q, k, gate_input, beta_logits, *gate)
            output, final_state = cp.chunk_kda(q, k, v, g, beta, chunk_size=self.chunk_size), None
        else:
            output, final_state = chunk_kda_from_raw(
                q,
                k,
                v,
                gate_input,
                beta_logits,
                *gate,
                initial_state=cache.recurrent_state if cache is not None else None,
                output_final_state=return_cache,
                chunk_size=self.chunk_size,
            )
        output = self._output(gate_projection, output, cp)
        new_cache = None
        if return_cache:
            assert final_state is not None  # asked for: output_final_state=return_cache
            new_cache = KDACache(final_state, (q_tail, k_tail, v_tail))
        return output, new_cache
