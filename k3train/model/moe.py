"""Stable LatentMoE (docs/design.md §1.4).

    y = shared_experts(x) + W_up · RMSNorm( Σ_{i ∈ TopK} p_i · E_i(W_down x) )

The router reads the full-width `x` in fp32: scores `s = sigmoid(x W_r)`, top-k on `s + b`
(`b` the balancing bias, a buffer updated between steps), weights `p` from the raw `s` of the
chosen experts, renormalised and scaled. Routed experts live in the latent width
(`routed_expert_hidden_size`); `GroupedExperts` computes them over tokens grouped by expert. With
expert parallelism (`LatentMoE(..., expert_parallel=...)`, see `k3train/parallel/expert.py`) this
rank keeps only its home experts and the dispatcher sends latent token slots to the experts'
ranks and brings the outputs back into the same slots. `pop_step_stats()` gives a step's
tokens per expert, dropped slots, replicated experts and EP wire bytes; `finish_expert_step`
(after the gradient reduction) plans the next step's replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3train.kernels.grouped_gemm import GroupPadding, grouped_mm, pads_groups
from k3train.kernels.precision import accumulation_dtype, upcast, without_autocast
from k3train.model.balance import build_balancer
from k3train.model.config import ModelConfig
from k3train.model.mlp import GLUMLP, glu_activation
from k3train.model.norm import RMSNorm
from k3train.parallel.expert import DispatchInfo, ExpertStacks
from k3train.parallel.expert_exchange import Phases, run_phases
from k3train.parallel.tensor import TensorParallel


def inside_backward() -> bool:
    """True while autograd runs a backward pass (e.g. recomputing a checkpointed forward)."""
    return torch._C._current_graph_task_id() != -1


class MoEGate(nn.Module):
    """Sigmoid router with the balancing bias `e_score_correction_bias` (HF names)."""

    e_score_correction_bias: torch.Tensor  # a buffer

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, with_cutoff: bool = False) -> tuple[torch.Tensor, ...]:
        """`x [tokens, d]` → (scores [tokens, n] fp32, expert ids [tokens, k], weights [tokens, k] fp32),
        and with `with_cutoff` also `α [tokens]`, the (k+1)-th largest biased score (the quantile
        balancers' statistic), from the same top-(k+1) call that chooses the experts: one `topk`
        per layer and micro-batch instead of two (the same experts as top-k unless the k-th and
        (k+1)-th biased scores tie exactly, where either is a top-k)."""
        with without_autocast(x.device):  # the router stays fp32 under bf16 autocast
            scores = torch.sigmoid(F.linear(upcast(x), upcast(self.weight)))
        cutoff = None
        with torch.no_grad():
            biased = scores + self.e_score_correction_bias
            if with_cutoff:
                top = biased.topk(self.top_k + 1, dim=-1)
                expert_ids, cutoff = top.indices[:, : self.top_k].contiguous(), top.values[:, self.top_k]
            else:
                expert_ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, expert_ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if with_cutoff:
            assert cutoff is not None  # set by the top-(k+1) branch above
            return scores, expert_ids, weights * self.scaling, cutoff
        return scores, expert_ids, weights * self.scaling


class GroupedExperts(nn.Module):
    """All routed experts of a layer as stacked weights `[experts, out, in]` (w1 gate, w3 up, w2 down)."""

    def __init__(self, config: ModelConfig, num_experts: int, grouped_gemm_factory=None, replica_groups: int = 0):
        super().__init__()
        latent, inner = config.expert_width, config.moe_intermediate_size
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, inner, latent))
        self.w3 = nn.Parameter(torch.empty(num_experts, inner, latent))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent, inner))
        self.activation = glu_activation(config)
        # Transformer Engine's grouped GEMMs (`kernels.te.GroupedExpertGEMM`, no parameters of
        # their own: they run on the stacks above), or None for `kernels.grouped_gemm`.
        self.te_gemms = (
            nn.ModuleList(
                [
                    grouped_gemm_factory(num_experts, latent, inner),
                    grouped_gemm_factory(num_experts, latent, inner),
                    grouped_gemm_factory(num_experts, inner, latent),
                ]
            )
            if grouped_gemm_factory is not None
            else None
        )
        # Expert parallelism's replica stacks (`replica_groups` experts of other ranks) run through
        # grouped GEMMs of their own: TE's GroupedLinear takes exactly one split per GEMM it was
        # built with, and its FP8 state then covers one call per micro-batch and module.
        self.replica_groups = replica_groups if grouped_gemm_factory is not None else 0
        self.te_replica_gemms = (
            nn.ModuleList(
                [
                    grouped_gemm_factory(replica_groups, latent, inner),
                    grouped_gemm_factory(replica_groups, latent, inner),
                    grouped_gemm_factory(replica_groups, inner, latent),
                ]
            )
            if grouped_gemm_factory is not None and replica_groups > 0
            else None
        )

    def stacks(self) -> ExpertStacks:
        """This module's own weight stacks `(w1, w3, w2)`."""
        return self.w1, self.w3, self.w2

    def forward_sorted(
        self,
        rows: torch.Tensor,
        group_ends: torch.Tensor,
        weights: ExpertStacks | None = None,
        row_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows sorted by expert (`group_ends` cumulative counts) through their experts: the GLU
        `w2 · act(w1 x, w3 x)` as grouped GEMMs. `weights`: stacks `(w1, w3, w2)` to use
        instead of the module's own (replicas of other ranks' experts, fetched for a step).
        `row_scale` `[rows]`: a factor per row applied inside the activation (`w2` is linear, so
        this is the output row times it): the routing weights, at no extra pass."""
        w1, w3, w2 = weights if weights is not None else self.stacks()
        scale = {} if row_scale is None else {"row_scale": row_scale}
        if self.te_gemms is not None:
            gemm1, gemm3, gemm2 = self._te_gemms_for(w1.shape[0])
            hidden = self.activation(gemm1(rows, group_ends, w1), gemm3(rows, group_ends, w3), **scale)
            return gemm2(hidden, group_ends, w2)
        padding = GroupPadding.bucketed(group_ends) if pads_groups(rows) else None
        if padding is not None:  # CPU bf16: GEMM shapes that repeat (kernels/grouped_gemm.py)
            rows, group_ends = padding.pad(rows), padding.ends
            scale = {key: padding.pad(value) for key, value in scale.items()}
        gate = grouped_mm(rows, w1.transpose(1, 2).to(rows.dtype), group_ends)
        up = grouped_mm(rows, w3.transpose(1, 2).to(rows.dtype), group_ends)
        # gate and up are this function's own GEMM outputs (their backward keeps only inputs):
        # the activation may keep its saved tensors in their buffers
        hidden = self.activation(gate, up, overwrite_inputs=True, **scale)
        out = grouped_mm(hidden, w2.transpose(1, 2).to(rows.dtype), group_ends)
        return out if padding is None else padding.unpad(out)

    def _te_gemms_for(self, groups: int) -> nn.ModuleList:
        """The TE grouped GEMMs built for stacks of `groups` experts (this module's own, or the
        replica slots')."""
        if groups == self.num_experts:
            assert self.te_gemms is not None
            return self.te_gemms
        if self.te_replica_gemms is not None and groups == self.replica_groups:
            return self.te_replica_gemms
        raise ValueError(
            f"no Transformer Engine grouped GEMMs for a stack of {groups} experts (this module has "
            f"{self.num_experts} experts and {self.replica_groups} "
            "replica slots): build it with replica_groups= the dispatcher's max_replicas"
        )

    def grouped_forward(
        self, rows: torch.Tensor, ids: torch.Tensor, weights: ExpertStacks | None = None, compute: str = "grouped"
    ) -> torch.Tensor:
        """Each row of `rows [N, l]`, in any order, through expert `ids [N]` (`0 ≤ id < G`, the
        stacks' experts; any other id marks an empty row, whose output is zero); `[N, l]` in
        `rows`' dtype, in the rows' order. This is what the expert-parallel dispatcher calls on
        the slots it received (`weights`: fetched replica stacks, as in `forward_sorted`).

        `compute="grouped"` sorts the rows by expert and runs `forward_sorted`; `"gather"`
        gathers each row's matrices instead (static shapes, no host read: tests, tiny shapes).
        """
        w1, w3, w2 = weights if weights is not None else self.stacks()
        groups, count = w1.shape[0], rows.shape[0]
        valid = (ids >= 0) & (ids < groups)
        key = torch.where(valid, ids, groups)
        if compute == "gather":
            index = key.clamp(max=groups - 1)
            w1, w3, w2 = (w.to(rows.dtype)[index] for w in (w1, w3, w2))
            gate = torch.einsum("nil,nl->ni", w1, rows)
            up = torch.einsum("nil,nl->ni", w3, rows)
            out = torch.einsum("nli,ni->nl", w2, self.activation(gate, up))
            return torch.where(valid[:, None], out, torch.zeros_like(out))
        if compute != "grouped":
            raise ValueError(f"compute must be 'grouped' or 'gather', got {compute!r}")
        order = torch.sort(key, stable=True).indices
        group_ends = (
            torch.zeros(groups + 1, dtype=torch.int64, device=rows.device)
            .scatter_add_(0, key, torch.ones_like(key))[:groups]
            .cumsum(0)
        )
        out_sorted = self.forward_sorted(rows.index_select(0, order), group_ends, (w1, w3, w2))
        if out_sorted.shape[0] < count:  # CPU loop path: rows after the last group were not computed
            out_sorted = torch.cat([out_sorted, out_sorted.new_zeros(count - out_sorted.shape[0], out_sorted.shape[1])])
        out = out_sorted.new_zeros(count, out_sorted.shape[1]).index_copy(0, order, out_sorted)
        return torch.where(valid[:, None], out, torch.zeros_like(out))  # rows past the last offset on CUDA

    def forward(self, latent: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`Σ_k weights[t, k] · E_{expert_ids[t, k]}(latent[t])` for every token `t`; `[tokens, latent]`."""
        records = torch.is_grad_enabled() and any(t.requires_grad for t in (latent, weights, *self.stacks()))
        if not records or self.te_gemms is not None:
            # Without autograd the gain is small and the exported remote code's operation order
            # (weights after the experts) keeps evaluation's fp32 logits bit-equal to it. With
            # Transformer Engine's (possibly FP8) GEMMs the weights stay out of the quantized
            # input of `w2`: scaling rows by (0, 1] weights would widen its dynamic range.
            return self.forward_reference(latent, expert_ids, weights)
        top_k = expert_ids.shape[-1]
        flat_ids = expert_ids.reshape(-1)
        slot_order = torch.argsort(flat_ids, stable=True)
        token_of_slot = slot_order // top_k
        group_ends = torch.bincount(flat_ids, minlength=self.num_experts).cumsum(0)
        # index_select, not latent[token_of_slot]: its backward is an index_add_, not the slower
        # accumulating index_put_; the routing weights ride in the activation's last pass
        # instead of a weighted copy of every output slot (benchmarks/fused_paths.py)
        outputs = self.forward_sorted(
            latent.index_select(0, token_of_slot), group_ends, row_scale=weights.reshape(-1).index_select(0, slot_order)
        )
        combined = torch.zeros(latent.shape, dtype=accumulation_dtype(outputs.dtype), device=latent.device)
        return combined.index_add_(0, token_of_slot, upcast(outputs)).to(latent.dtype)

    def forward_reference(self, latent: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward` as plain indexing: each slot's expert output weighted after the GLU, summed back."""
        top_k = expert_ids.shape[-1]
        slot_order = torch.argsort(expert_ids.reshape(-1), stable=True)
        token_of_slot = slot_order // top_k
        group_ends = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts).cumsum(0)
        outputs = self.forward_sorted(latent[token_of_slot], group_ends)
        weighted = upcast(outputs) * weights.reshape(-1)[slot_order, None]
        combined = torch.zeros(latent.shape, dtype=weighted.dtype, device=latent.device)
        return combined.index_add_(0, token_of_slot, weighted).to(latent.dtype)


@dataclass
class MoEStepStats:
    """One MoE layer's routing over a step (all micro-batches), for the step line and metrics.jsonl."""

    expert_load: torch.Tensor  # [experts] int64: slots routed to each expert
    routed_slots: int  # tokens · top_k
    dropped_slots: int  # slots that did not reach their expert (capacity overflow)
    replicated_experts: float  # replica placements per micro-batch (balanced expert parallelism)
    micro_batches: int
    token_wire_bytes: float = 0.0  # EP dispatch + combine bytes one rank sends this step (mean over ranks)
    replica_wire_bytes: float = 0.0  # EP replica weights + their gradients one rank sends this step

    @property
    def load_max_over_mean(self) -> float:
        mean = self.expert_load.double().mean().item()
        return self.expert_load.max().item() / mean if mean > 0 else 0.0

    @property
    def dropped_fraction(self) -> float:
        return self.dropped_slots / self.routed_slots if self.routed_slots else 0.0

    def as_dict(self) -> dict[str, float]:
        mean = self.expert_load.double().mean().item()
        return {
            "tokens_per_expert_max": int(self.expert_load.max().item()),
            "tokens_per_expert_mean": mean,
            "load_max_over_mean": self.load_max_over_mean,
            "dropped_slots": self.dropped_slots,
            "dropped_fraction": self.dropped_fraction,
            "replicated_experts": self.replicated_experts,
            "ep_token_bytes": self.token_wire_bytes,
            "ep_replica_bytes": self.replica_wire_bytes,
        }


class LatentMoE(nn.Module):
    """Router, latent projections and routed experts on this rank's tokens; the shared experts are
    a TP region.

    `expert_parallel` (a `k3train.parallel.expert.ExpertParallel`, or None): with it this rank
    holds only its `E/ep` home experts as `experts.w1/w3/w2` (marked `expert_parallel = True`
    with their `expert_offset`) and the routed experts run through its fixed-size dispatch.
    """

    step_expert_load: torch.Tensor  # buffers
    step_dispatch_counts: torch.Tensor

    def __init__(self, config: ModelConfig, tensor_parallel: TensorParallel | None = None, expert_parallel=None):
        super().__init__()
        self.config = config
        tp = tensor_parallel or TensorParallel.single()
        self.expert_parallel = expert_parallel
        self.gate = MoEGate(config)
        latent = config.routed_expert_hidden_size  # None: a plain MoE, no latent projections (Kimi Linear)
        self.routed_expert_down_proj = tp.linear(config.hidden_size, latent) if latent is not None else None
        num_local = config.num_experts if expert_parallel is None else expert_parallel.num_local_experts
        replica_groups = 0 if expert_parallel is None else expert_parallel.replica_slots
        self.experts = GroupedExperts(config, num_local, tp.grouped_gemm_factory, replica_groups)
        if expert_parallel is not None:
            expert_parallel.mark_expert_params(self.experts)
        self.routed_expert_norm = (
            RMSNorm(latent, config.rms_norm_eps) if config.latent_moe_use_norm and latent is not None else None
        )
        self.routed_expert_up_proj = tp.linear(latent, config.hidden_size) if latent is not None else None
        self.shared_experts = (
            GLUMLP(config, config.hidden_size, config.num_shared_experts * config.moe_intermediate_size, tp)
            if config.num_shared_experts > 0
            else None
        )
        if tp.sequence_parallel:  # each TP rank routes its own tokens: gradients are partial sums
            routed = [
                p
                for name, p in self.named_parameters()
                if not name.startswith("shared_experts.") and not getattr(p, "expert_parallel", False)
            ]  # EP experts already sum every token
            tp.mark_partial_grad(routed)
        self.balancer = build_balancer(config)
        # Routing over the current step, for metrics (not saved): slots per expert, then
        # [routed slots, dropped slots, replica placements, micro-batches (a half of one under
        # parallel.ep_overlap_halves counts as one), EP token bytes, EP replica bytes].
        self.register_buffer("step_expert_load", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("step_dispatch_counts", torch.zeros(6, dtype=torch.int64), persistent=False)
        self.last_dispatch: DispatchInfo | None = None  # the latest ExpertParallel DispatchInfo (diagnostics, tests)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_phases(self.forward_phases(x))

    def forward_phases(self, x: torch.Tensor) -> Phases[torch.Tensor]:
        """`forward` as a phase generator: it yields while the expert-parallel exchanges are on the
        wire (an overlapping dispatcher's `dispatch_phases`), so that the model runs the other
        half of the micro-batch there (`parallel.ep_overlap_halves`); otherwise it never yields."""
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        collect = self.training and torch.is_grad_enabled() and not inside_backward()
        cutoff = None
        if collect and self.balancer.uses_cutoff:
            scores, expert_ids, weights, cutoff = self.gate(tokens, with_cutoff=True)
        else:
            scores, expert_ids, weights = self.gate(tokens)
        if collect:
            with torch.no_grad():  # statistics for the next step's bias; never twice under recompute
                self.balancer.observe(scores.detach(), self.gate.e_score_correction_bias, cutoff)
                flat_ids = expert_ids.flatten()  # scatter_add, not bincount: no host sync on CUDA
                self.step_expert_load.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
        latent = self.routed_expert_down_proj(tokens) if self.routed_expert_down_proj is not None else tokens
        shared: torch.Tensor | None = None
        if self.expert_parallel is None:
            routed = self.experts(latent, expert_ids, weights)
        else:
            side: list[torch.Tensor] = []
            alongside = None
            if self.shared_experts is not None and self.expert_parallel.overlaps:
                shared_experts = self.shared_experts

                def alongside() -> None:  # the shared experts while the first chunk's rows travel
                    side.append(shared_experts(x))

            routed, self.last_dispatch = yield from self.expert_parallel.dispatch_phases(
                latent, expert_ids, weights, self.experts, alongside
            )
            shared = side[0] if side else None
        if collect:
            with torch.no_grad():  # device-side counters: nothing is read on the host here
                counts = self.step_dispatch_counts
                counts[0] += expert_ids.numel()
                counts[3] += 1
                if self.expert_parallel is not None:
                    assert self.last_dispatch is not None  # set by the expert-parallel call above
                    counts[1] += self.last_dispatch.dropped
                    counts[2] += self.last_dispatch.replicas
                    counts[4] += self.last_dispatch.wire_bytes
                    counts[5] += self.last_dispatch.replica_bytes
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)
        output = (self.routed_expert_up_proj(routed) if self.routed_expert_up_proj is not None else routed).view(shape)
        if self.shared_experts is not None:  # [batch, seq, hidden]: a TP region gathers the sequence
            if shared is None:
                shared = self.shared_experts(x)
            if (
                torch.is_grad_enabled()
                and shared.shape == output.shape
                and shared.dtype == output.dtype
                and not shared._is_view()
            ):
                # the shared experts' fresh output (a projection's, nothing saves it) takes the
                # sum: no new [tokens, hidden] tensor; the same values as `output + shared`. Not
                # when it is a view (a tensor-parallel region's reduce-scatter returns one, and
                # autograd forbids writing into a custom function's view output).
                return shared.add_(output)
            output = output + shared
        return output

    @torch.no_grad()
    def update_routing_bias(self, group=None) -> None:
        """Replace the bias by the balancer's estimate from this step (used from the next step on).

        `group`: the ranks that routed distinct tokens through this layer this step; their
        statistics are combined so that every rank computes the same bias.
        """
        bias = self.gate.e_score_correction_bias
        bias.copy_(self.balancer.next_bias(bias, group))

    def pop_step_stats(self, group=None, ranks: int = 1) -> MoEStepStats:
        """This step's routing statistics, then reset them (call once per step, after backward).

        `group` (optional): sum over these ranks first (e.g. `routing_statistics_group(state)`),
        so that the loads are the layer's global ones; replica placements are then averaged.
        `ranks`: how many ranks the statistics were already summed over by
        `pool_routing_statistics` (then pass no `group`).
        """
        packed = torch.cat([self.step_expert_load, self.step_dispatch_counts])
        self.step_expert_load.zero_()
        self.step_dispatch_counts.zero_()
        size = ranks
        if group is not None and group.size > 1:
            group.all_reduce(packed)
            size = group.size
        experts = self.config.num_experts
        routed, dropped, replicas, micro_batches, token_bytes, replica_bytes = packed[experts:].tolist()
        micro_batches //= size
        return MoEStepStats(
            packed[:experts].cpu(),
            routed,
            dropped,
            replicas / size / max(micro_batches, 1),
            micro_batches,
            token_bytes / size,
            replica_bytes / size,
        )

    def summable_statistics(self) -> list[torch.Tensor]:
        """Every statistic of this step that ranks combine by summation (int64, reduced in place)."""
        return [self.step_expert_load, self.step_dispatch_counts, *self.balancer.summable_statistics()]


def pool_routing_statistics(moe_layers: list[LatentMoE], group) -> int:
    """Sum every MoE layer's step statistics (tokens per expert, dispatch counters, balancer
    histograms or loads) over `group` with ONE all-reduce, instead of two per layer (at K3 size
    184 messages per stage). Returns the number of ranks summed over, for `pop_step_stats(ranks=)`.
    The exact quantile balancer's margins are gathered later by `update_routing_bias(group)`.
    """
    if group is None or group.size == 1 or not moe_layers:
        return 1
    statistics = [tensor for moe in moe_layers for tensor in moe.summable_statistics()]
    flat = torch.cat([tensor.reshape(-1) for tensor in statistics])
    group.all_reduce(flat)
    offset = 0
    for tensor in statistics:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    for moe in moe_layers:
        moe.balancer.pooled = True
    return group.size


def finish_expert_step(moe_layers: list[LatentMoE], state=None) -> None:
    """The step boundary of expert parallelism, after the gradient reduction and before clipping:
    each dispatcher plans the next step's replicas and drops this step's (their gradients went
    home in the step's last backward). A no-op without expert parallelism."""
    dispatchers = {
        id(moe.expert_parallel): moe.expert_parallel for moe in moe_layers if moe.expert_parallel is not None
    }
    for dispatcher in dispatchers.values():
        dispatcher.finish_step(state)
