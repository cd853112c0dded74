"""The Attention Residuals mix (depth attention over earlier block representations).

For sources `v_0..v_m` (each `[..., d]`), a learned query `w` and the keys' RMSNorm gain `γ`:
`k_i = RMSNorm(v_i)`, `s_i = (γ ⊙ w)ᵀ k_i`, `α = softmax_i(s)`, output `Σ α_i v_i` over the raw
values. Scores, softmax and the weighted sum run in fp32 whatever the input dtype (the Hugging
Face reference does the same), and the result is cast back to the sources' dtype.

Two forms of one definition:

- `attn_res_mix_reference`: the definition in plain PyTorch (stacks the sources into one
  `[..., m, d]` tensor, normalises them as keys, autograd differentiates it). Tests compare the
  fast path against it.
- `attn_res_mix` / `attn_res_mix_rmsnorm`: the training path. The keys are never formed: since
  `k_i = r_i v_i` with the per-token scalar `r_i = (mean(v_i²) + ε)^{-1/2}`, each score is a
  matrix–vector product of one source with `γ ⊙ w` times `r_i`, and the backward is written out
  (below), so a mix keeps only `[m, tokens]` scalars (the weights `α`, `r` and the scores) besides
  the sources it already holds, instead of `[tokens, m, d]` stacks. With the output RMSNorm fused
  (`attn_res_mix_rmsnorm`, what a checkpointed sublayer input needs), the mixed hidden state is
  not saved either: backward rebuilds it as `Σ α_i v_i` from the saved weights (m multiply-adds)
  instead of rerunning the whole mix.

The backward, per token, with `t_i = (γ ⊙ w)ᵀ v_i`, `s_i = r_i t_i`, incoming gradient `g`:

    ∂L/∂α_i = gᵀ v_i,     ∂L/∂s_i = α_i (∂L/∂α_i − Σ_j α_j ∂L/∂α_j)
    ∂L/∂v_i = α_i g + (∂L/∂s_i) r_i (γ ⊙ w) − (∂L/∂s_i) s_i r_i² / d · v_i
    ∂L/∂(γ ⊙ w) = Σ_tokens Σ_i (∂L/∂s_i) r_i v_i
"""

from __future__ import annotations

from typing import Sequence

import torch

from k3train.kernels.precision import upcast, without_autocast


def attn_res_mix_reference(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """The definition, stacked and differentiated by autograd; returns `[..., d]`."""
    with without_autocast(sources[0].device):  # bf16 autocast must not downcast the mix
        values = torch.stack([upcast(source) for source in sources], dim=-2)  # [..., sources, d]
        keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
        score_weight = upcast(norm_weight) * upcast(query)
        probabilities = (keys * score_weight).sum(-1).softmax(-1)  # [..., sources]
        mixed = (probabilities.unsqueeze(-2) @ values).squeeze(-2)
    return mixed.to(sources[0].dtype)


def _rows(source: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., d]` -> `[tokens, d]` in the accumulation dtype (a view for fp32/fp64 sources)."""
    return source.reshape(-1, source.shape[-1]).to(dtype)


def _mix_forward(sources: Sequence[torch.Tensor], score_weight: torch.Tensor, eps: float):
    """Weights `α`, inverse key norms `r` and scores `s` (each `[m, tokens]`) and `Σ α_i v_i`."""
    dtype = score_weight.dtype
    dim = sources[0].shape[-1]
    dots, inverse_norms = [], []
    for source in sources:
        rows = _rows(source, dtype)
        dots.append(rows @ score_weight)  # (γ ⊙ w)ᵀ v_i: the keys are never formed
        inverse_norms.append(torch.linalg.vector_norm(rows, dim=-1))
    inverse_norm = torch.rsqrt(torch.stack(inverse_norms).square_().div_(dim).add_(eps))
    scores = torch.stack(dots).mul_(inverse_norm)
    probabilities = scores.softmax(0)
    return probabilities, inverse_norm, scores, _weighted_sum(sources, probabilities)


def _weighted_sum(sources: Sequence[torch.Tensor], probabilities: torch.Tensor) -> torch.Tensor:
    dtype = probabilities.dtype
    mixed = _rows(sources[0], dtype) * probabilities[0].unsqueeze(-1)
    for source, weight in zip(sources[1:], probabilities[1:]):
        mixed.addcmul_(_rows(source, dtype), weight.unsqueeze(-1))
    return mixed  # [tokens, d]


def _mix_backward(sources, score_weight, probabilities, inverse_norm, scores, grad_mixed, needs_source_grads):
    """Gradients of the sources (None where not needed) and of `γ ⊙ w`, from `∂L/∂mixed`."""
    dtype = score_weight.dtype
    dim = score_weight.shape[0]
    grad_weights = torch.stack([(_rows(source, dtype) * grad_mixed).sum(-1) for source in sources])
    grad_scores = probabilities * (grad_weights - (probabilities * grad_weights).sum(0, keepdim=True))
    along_query = grad_scores * inverse_norm  # ∂L/∂s_i · r_i
    along_value = grad_scores * scores * inverse_norm.square() / dim  # ∂L/∂s_i · s_i r_i² / d
    grad_score_weight = torch.zeros_like(score_weight)
    grad_sources = []
    for index, source in enumerate(sources):
        rows = _rows(source, dtype)
        grad_score_weight.addmv_(rows.t(), along_query[index])
        if not needs_source_grads[index]:
            grad_sources.append(None)
            continue
        grad = grad_mixed * probabilities[index].unsqueeze(-1)
        grad.addcmul_(rows, along_value[index].unsqueeze(-1), value=-1.0)
        grad.addr_(along_query[index], score_weight)
        grad_sources.append(grad.view(source.shape).to(source.dtype))
    return grad_sources, grad_score_weight


class _AttnResMix(torch.autograd.Function):
    """`attn_res_mix` with the written-out backward; saves the sources and `[3, m, tokens]`."""

    @staticmethod
    def forward(ctx, norm_weight, query, eps, *sources):
        score_weight = upcast(norm_weight) * upcast(query)
        probabilities, inverse_norm, scores, mixed = _mix_forward(sources, score_weight, eps)
        ctx.save_for_backward(norm_weight, query, probabilities, inverse_norm, scores, *sources)
        return mixed.view(sources[0].shape).to(sources[0].dtype)

    @staticmethod
    def backward(ctx, grad_output):
        norm_weight, query, probabilities, inverse_norm, scores, *sources = ctx.saved_tensors
        score_weight = upcast(norm_weight) * upcast(query)
        grad_mixed = _rows(grad_output, score_weight.dtype)
        grad_sources, grad_score_weight = _mix_backward(
            sources, score_weight, probabilities, inverse_norm, scores, grad_mixed, ctx.needs_input_grad[3:])
        return _parameter_grads(ctx, norm_weight, query, grad_score_weight) + (None, *grad_sources)


class _AttnResMixRMSNorm(torch.autograd.Function):
    """`RMSNorm(mix(sources))` that saves no `[tokens, d]` tensor of its own: backward rebuilds
    the mixed state from the saved weights."""

    @staticmethod
    def forward(ctx, norm_weight, query, eps, out_weight, out_eps, *sources):
        score_weight = upcast(norm_weight) * upcast(query)
        probabilities, inverse_norm, scores, mixed = _mix_forward(sources, score_weight, eps)
        # Rounded to the sources' dtype first, as `RMSNorm(attn_res_mix(...))` would see it.
        mixed = upcast(mixed.to(sources[0].dtype))
        out_inverse_norm = torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + out_eps)
        output = (upcast(out_weight) * (mixed * out_inverse_norm)).to(sources[0].dtype)
        ctx.save_for_backward(norm_weight, query, out_weight, probabilities, inverse_norm, scores,
                              out_inverse_norm, *sources)
        return output.view(sources[0].shape)

    @staticmethod
    def backward(ctx, grad_output):
        norm_weight, query, out_weight, probabilities, inverse_norm, scores, out_inverse_norm, *sources = (
            ctx.saved_tensors)
        score_weight = upcast(norm_weight) * upcast(query)
        dtype = score_weight.dtype
        mixed = upcast(_weighted_sum(sources, probabilities).to(sources[0].dtype))  # not the whole mix again
        normalized = mixed * out_inverse_norm
        grad_output = _rows(grad_output, dtype)
        grad_out_weight = (grad_output * normalized).sum(0).to(out_weight.dtype) if ctx.needs_input_grad[3] else None
        grad_normalized = grad_output * upcast(out_weight)
        # RMSNorm backward: ρ (ĝ − x̂ · mean(ĝ ⊙ x̂)) with x̂ = x ρ.
        projection = (grad_normalized * normalized).mean(-1, keepdim=True)
        grad_mixed = grad_normalized.sub_(normalized.mul_(projection)).mul_(out_inverse_norm)
        grad_sources, grad_score_weight = _mix_backward(
            sources, score_weight, probabilities, inverse_norm, scores, grad_mixed, ctx.needs_input_grad[5:])
        grad_norm_weight, grad_query = _parameter_grads(ctx, norm_weight, query, grad_score_weight)
        return (grad_norm_weight, grad_query, None, grad_out_weight, None, *grad_sources)


def _parameter_grads(ctx, norm_weight, query, grad_score_weight):
    """`∂L/∂γ`, `∂L/∂w` from `∂L/∂(γ ⊙ w)`."""
    grad_norm_weight = (grad_score_weight * upcast(query)).to(norm_weight.dtype) if ctx.needs_input_grad[0] else None
    grad_query = (grad_score_weight * upcast(norm_weight)).to(query.dtype) if ctx.needs_input_grad[1] else None
    return grad_norm_weight, grad_query


def _check_sources(sources: Sequence[torch.Tensor]) -> None:
    if not sources:
        raise ValueError("attn_res_mix needs at least one source")
    if any(source.shape != sources[0].shape or source.dtype != sources[0].dtype for source in sources):
        raise ValueError("attn_res_mix sources must share one shape and dtype, got "
                         f"{[(tuple(s.shape), s.dtype) for s in sources]}")


def attn_res_mix(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """Mix `sources` (all of one shape `[..., d]`) with depth attention; returns `[..., d]`."""
    _check_sources(sources)
    with without_autocast(sources[0].device):  # bf16 autocast must not downcast the mix
        return _AttnResMix.apply(norm_weight, query, eps, *sources)


def attn_res_mix_rmsnorm(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float,
    out_weight: torch.Tensor, out_eps: float,
) -> torch.Tensor:
    """`RMSNorm(attn_res_mix(sources, ...))` with gain `out_weight` (computed in fp32 or wider, cast
    back, as `k3train.model.norm.RMSNorm`); saves only the sources and per-token scalars."""
    _check_sources(sources)
    with without_autocast(sources[0].device):
        return _AttnResMixRMSNorm.apply(norm_weight, query, eps, out_weight, out_eps, *sources)

