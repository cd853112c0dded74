"""Stable LatentMoE (SPEC §1.4).

    y = shared_experts(x) + W_up · RMSNorm( Σ_{i ∈ TopK} p_i · E_i(W_down x) )

The router reads the full-width `x` in fp32: scores `s = sigmoid(x W_r)`, top-k on `s + b`
(`b` the balancing bias, a buffer updated between steps), weights `p` from the raw `s` of the
chosen experts, renormalised and scaled. Routed experts live in the latent width
(`routed_expert_hidden_size`); `LocalExperts` computes them over tokens grouped by expert, and
is the seam where the expert-parallel dispatcher plugs in (latent token slots in, outputs back
in the same slots).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3train.kernels.grouped_gemm import grouped_mm
from k3train.kernels.precision import upcast
from k3train.model.balance import build_balancer
from k3train.model.config import ModelConfig
from k3train.model.mlp import GLUMLP, glu_activation
from k3train.model.norm import RMSNorm
from k3train.parallel.tensor import TensorParallel


def inside_backward() -> bool:
    """True while autograd runs a backward pass (e.g. recomputing a checkpointed forward)."""
    return torch._C._current_graph_task_id() != -1


class MoEGate(nn.Module):
    """Sigmoid router with the balancing bias `e_score_correction_bias` (HF names)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`x [tokens, d]` → (scores [tokens, n] fp32, expert ids [tokens, k], weights [tokens, k] fp32)."""
        scores = torch.sigmoid(F.linear(upcast(x), upcast(self.weight)))
        with torch.no_grad():
            expert_ids = (scores + self.e_score_correction_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, expert_ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, expert_ids, weights * self.scaling


class LocalExperts(nn.Module):
    """All routed experts of a layer as stacked weights `[experts, out, in]` (w1 gate, w3 up, w2 down)."""

    def __init__(self, config: ModelConfig, num_experts: int):
        super().__init__()
        latent, inner = config.routed_expert_hidden_size, config.moe_intermediate_size
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, inner, latent))
        self.w3 = nn.Parameter(torch.empty(num_experts, inner, latent))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent, inner))
        self.activation = glu_activation(config)

    def forward_grouped(self, tokens: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
        """Rows of `tokens` sorted by expert (`group_ends` cumulative counts) through their experts."""
        gate = grouped_mm(tokens, self.w1.transpose(1, 2).to(tokens.dtype), group_ends)
        up = grouped_mm(tokens, self.w3.transpose(1, 2).to(tokens.dtype), group_ends)
        return grouped_mm(self.activation(gate, up), self.w2.transpose(1, 2).to(tokens.dtype), group_ends)

    def forward(self, latent: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`Σ_k weights[t, k] · E_{expert_ids[t, k]}(latent[t])` for every token `t`; `[tokens, latent]`."""
        top_k = expert_ids.shape[-1]
        flat_ids = expert_ids.reshape(-1)
        slot_order = torch.argsort(flat_ids, stable=True)
        token_of_slot = slot_order // top_k
        group_ends = torch.bincount(flat_ids, minlength=self.num_experts).cumsum(0)
        outputs = self.forward_grouped(latent[token_of_slot], group_ends)
        weighted = upcast(outputs) * weights.reshape(-1)[slot_order, None]
        combined = torch.zeros(latent.shape, dtype=weighted.dtype, device=latent.device)
        return combined.index_add_(0, token_of_slot, weighted).to(latent.dtype)


class LatentMoE(nn.Module):
    """Router, latent projections and routed experts run on this rank's tokens with replicated
    weights (expert parallelism distributes the experts later); the shared experts are a TP region."""

    def __init__(self, config: ModelConfig, tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.config = config
        tp = tensor_parallel or TensorParallel.single()
        self.gate = MoEGate(config)
        self.routed_expert_down_proj = nn.Linear(config.hidden_size, config.routed_expert_hidden_size, bias=False)
        self.experts = LocalExperts(config, config.num_experts)
        self.routed_expert_norm = (
            RMSNorm(config.routed_expert_hidden_size, config.rms_norm_eps) if config.latent_moe_use_norm else None
        )
        self.routed_expert_up_proj = nn.Linear(config.routed_expert_hidden_size, config.hidden_size, bias=False)
        self.shared_experts = (
            GLUMLP(config, config.hidden_size, config.num_shared_experts * config.moe_intermediate_size, tp)
            if config.num_shared_experts > 0 else None
        )
        if tp.sequence_parallel:  # each TP rank routes its own tokens: gradients are partial sums
            routed = [p for name, p in self.named_parameters() if not name.startswith("shared_experts.")]
            tp.mark_partial_grad(routed)
        self.balancer = build_balancer(config)
        # Tokens per expert over the current step, for metrics (not saved).
        self.register_buffer("step_expert_load", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        scores, expert_ids, weights = self.gate(tokens)
        if self.training and torch.is_grad_enabled() and not inside_backward():
            with torch.no_grad():  # statistics for the next step's bias; never twice under recompute
                self.balancer.observe(scores.detach(), self.gate.e_score_correction_bias)
                self.step_expert_load += torch.bincount(expert_ids.flatten(), minlength=self.config.num_experts)
        routed = self.experts(self.routed_expert_down_proj(tokens), expert_ids, weights)
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)
        output = self.routed_expert_up_proj(routed).view(shape)
        if self.shared_experts is not None:  # [batch, seq, hidden]: a TP region gathers the sequence
            output = output + self.shared_experts(x)
        return output

    @torch.no_grad()
    def update_routing_bias(self, group=None) -> None:
        """Replace the bias by the balancer's estimate from this step (used from the next step on).

        `group`: the ranks that routed distinct tokens through this layer this step; their
        statistics are combined so that every rank computes the same bias.
        """
        bias = self.gate.e_score_correction_bias
        bias.copy_(self.balancer.next_bias(bias, group))

    def pop_step_load(self) -> torch.Tensor:
        load = self.step_expert_load.clone()
        self.step_expert_load.zero_()
        return load
