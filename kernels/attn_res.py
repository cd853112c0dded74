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

import contextlib
from typing import Optional, Sequence

import torch

from k3train.kernels.precision import upcast, without_autocast


def attn_res_mix_reference(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """The definition, stacked and differentiated by autograd; returns `[..., d]`."""
    with without_autocast(sources[0].device):  # bf16 autocast must not downcast the mix
        values = torch.stack([upcast(source) for source in sources], dim=-2)  # [..., sources, d]
        keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
        score_weight = upcast(norm_weight) * upcast(query).reshape(-1)
        probabilities = (keys * score_weight).sum(-1).softmax(-1)  # [..., sources]
        mixed = (probabilities.unsqueeze(-2) @ values).squeeze(-2)
    return mixed.to(sources[0].dtype)


def _score_weight(norm_weight: torch.Tensor, query: torch.Tensor, sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """`γ ⊙ w` (`[d]`) in the computation's dtype: fp32 or wider, and no narrower than any source
    (under bf16 autocast the embedding's fp32 output meets bf16 sublayer outputs)."""
    dtype = torch.promote_types(upcast(norm_weight).dtype, query.dtype)
    for source_dtype in {source.dtype for source in sources}:
        dtype = torch.promote_types(dtype, source_dtype)
    return norm_weight.to(dtype) * query.reshape(-1).to(dtype)


def _rows(sources: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each `[..., d]` source as `[tokens, d]` in the accumulation dtype (views for fp32/fp64)."""
    return [source.reshape(-1, source.shape[-1]).to(dtype) for source in sources]


def _scores(rows: list[torch.Tensor], score_weight: torch.Tensor, eps: float):
    """Weights `α`, inverse key norms `r` and scores `s`, each `[m, tokens]`."""
    dim = score_weight.shape[0]
    dots = torch.stack([source @ score_weight for source in rows])  # (γ ⊙ w)ᵀ v_i: no keys formed
    norms = torch.stack([torch.linalg.vector_norm(source, dim=-1) for source in rows])
    inverse_norm = torch.rsqrt(norms.square_().div_(dim).add_(eps))
    scores = dots.mul_(inverse_norm)
    return scores.softmax(0), inverse_norm, scores


def _weighted_sum(rows: list[torch.Tensor], probabilities: torch.Tensor) -> torch.Tensor:
    weights = probabilities.unsqueeze(-1).unbind(0)
    mixed = rows[0] * weights[0]
    for source, weight in zip(rows[1:], weights[1:]):
        mixed.addcmul_(source, weight)
    return mixed  # [tokens, d]


def _mix_backward(rows, score_weight, probabilities, inverse_norm, scores, grad_mixed, grad_scale,
                  source_grads: bool):
    """Gradients of the sources (a list of `[tokens, d]`, or None if `not source_grads`) and of
    `γ ⊙ w`, from `∂L/∂mixed = grad_scale ⊙ grad_mixed` (`grad_scale` a per-token `[tokens]`
    factor or None: folded into the per-token scalars, so no caller spends a pass applying it)."""
    count, dim = len(rows), score_weight.shape[0]
    grad_weights = torch.stack([torch.linalg.vecdot(source, grad_mixed) for source in rows])  # gᵀ v_i
    if grad_scale is not None:
        grad_weights.mul_(grad_scale)
    grad_scores = probabilities * (grad_weights - (probabilities * grad_weights).sum(0, keepdim=True))
    along_query = grad_scores * inverse_norm  # ∂L/∂s_i · r_i
    along_value = along_query * scores * inverse_norm / -dim  # −∂L/∂s_i · s_i r_i² / d
    grad_score_weight = torch.zeros_like(score_weight)
    for source, weight in zip(rows, along_query):
        grad_score_weight.addmv_(source.t(), weight)
    if not source_grads:
        return None, grad_score_weight
    # α_i g + (∂L/∂s_i r_i) (γ ⊙ w) for every source at once, then − (∂L/∂s_i s_i r_i² / d) v_i.
    weights = probabilities if grad_scale is None else probabilities * grad_scale
    grads = weights.unsqueeze(-1) * grad_mixed
    grads.baddbmm_(along_query.unsqueeze(-1), score_weight.expand(count, 1, dim))
    grads = grads.unbind(0)
    for grad, source, weight in zip(grads, rows, along_value.unsqueeze(-1).unbind(0)):
        grad.addcmul_(source, weight)
    return grads, grad_score_weight


def _source_grads(grads, sources, needs_input_grad) -> list:
    if grads is None:
        return [None] * len(sources)
    return [grad.view(source.shape).to(source.dtype) if needed else None
            for grad, source, needed in zip(grads, sources, needs_input_grad)]


class _AttnResMix(torch.autograd.Function):
    """`attn_res_mix` with the written-out backward; saves the sources and `[3, m, tokens]`."""

    @staticmethod
    def forward(ctx, norm_weight, query, eps, *sources):
        score_weight = _score_weight(norm_weight, query, sources)
        rows = _rows(sources, score_weight.dtype)
        probabilities, inverse_norm, scores = _scores(rows, score_weight, eps)
        mixed = _weighted_sum(rows, probabilities)
        ctx.save_for_backward(norm_weight, query, probabilities, inverse_norm, scores, *sources)
        return mixed.view(sources[0].shape).to(sources[0].dtype)

    @staticmethod
    def backward(ctx, grad_output):
        norm_weight, query, probabilities, inverse_norm, scores, *sources = ctx.saved_tensors
        score_weight = _score_weight(norm_weight, query, sources)
        (grad_mixed,) = _rows([grad_output], score_weight.dtype)
        grads, grad_score_weight = _mix_backward(_rows(sources, score_weight.dtype), score_weight, probabilities,
                                                 inverse_norm, scores, grad_mixed, None, any(ctx.needs_input_grad[3:]))
        return (*_parameter_grads(ctx, norm_weight, query, grad_score_weight), None,
                *_source_grads(grads, sources, ctx.needs_input_grad[3:]))


class _AttnResMixRMSNorm(torch.autograd.Function):
    """`RMSNorm(mix(sources))`. It saves what a plain RMSNorm saves (one `[tokens, d]` tensor, the
    mixed state, and the per-token inverse norm) besides the sources; backward recomputes the
    scores (a matrix–vector product and a norm per source, cheaper than rebuilding the mixed
    state from saved weights, and no `[m, tokens]` scalars to keep)."""

    @staticmethod
    def forward(ctx, norm_weight, query, eps, out_weight, out_eps, *sources):
        score_weight = _score_weight(norm_weight, query, sources)
        rows = _rows(sources, score_weight.dtype)
        probabilities, _, _ = _scores(rows, score_weight, eps)
        # Rounded to the sources' dtype, as `RMSNorm(attn_res_mix(...))` would see it.
        mixed = _weighted_sum(rows, probabilities).to(sources[0].dtype)
        wide = upcast(mixed)
        dim = wide.shape[-1]
        out_inverse_norm = torch.linalg.vector_norm(wide, dim=-1).square_().div_(dim).add_(out_eps).rsqrt_()
        output = (wide * out_inverse_norm.unsqueeze(-1)).mul_(upcast(out_weight)).to(sources[0].dtype)
        ctx.eps = eps
        ctx.save_for_backward(norm_weight, query, out_weight, out_inverse_norm, mixed, *sources)
        return output.view(sources[0].shape)

    @staticmethod
    def backward(ctx, grad_output):
        norm_weight, query, out_weight, out_inverse_norm, mixed, *sources = ctx.saved_tensors
        score_weight = _score_weight(norm_weight, query, sources)
        dtype = score_weight.dtype
        rows = _rows(sources, dtype)
        probabilities, inverse_norm, scores = _scores(rows, score_weight, ctx.eps)
        mixed = mixed.to(dtype)
        (grad_output,) = _rows([grad_output], dtype)
        gain = upcast(out_weight)
        dim = gain.shape[0]
        # RMSNorm backward with x̂ = ρ x, ĝ = g ⊙ gain: ∂L/∂x = ρ (ĝ − x̂ · mean(ĝ ⊙ x̂)) and
        # ∂L/∂gain = Σ_tokens g ⊙ x̂; both from g ⊙ x (one pass) and two matrix–vector products.
        # ρ stays a per-token factor that the mix's backward folds into its own scalars.
        product = grad_output * mixed  # g ⊙ x
        grad_out_weight = ((product.t() @ out_inverse_norm).to(out_weight.dtype)
                           if ctx.needs_input_grad[3] else None)
        projection = (product @ gain).mul_(out_inverse_norm.square()).div_(-dim)  # −ρ² mean(ĝ ⊙ x)
        del product
        grad_unscaled = torch.mul(mixed, projection.unsqueeze(-1)).addcmul_(grad_output, gain)  # ∂L/∂x / ρ
        grads, grad_score_weight = _mix_backward(rows, score_weight, probabilities, inverse_norm, scores,
                                                 grad_unscaled, out_inverse_norm, any(ctx.needs_input_grad[5:]))
        grad_norm_weight, grad_query = _parameter_grads(ctx, norm_weight, query, grad_score_weight)
        return (grad_norm_weight, grad_query, None, grad_out_weight, None,
                *_source_grads(grads, sources, ctx.needs_input_grad[5:]))


def _parameter_grads(ctx, norm_weight, query, grad_score_weight):
    """`∂L/∂γ`, `∂L/∂w` from `∂L/∂(γ ⊙ w)`."""
    grad_norm_weight = ((grad_score_weight * upcast(query).reshape(-1)).to(norm_weight.dtype)
                        if ctx.needs_input_grad[0] else None)
    grad_query = ((grad_score_weight * upcast(norm_weight)).to(query.dtype).view(query.shape)
                  if ctx.needs_input_grad[1] else None)
    return grad_norm_weight, grad_query


def _check_sources(sources: Sequence[torch.Tensor]) -> None:
    if not sources:
        raise ValueError("attn_res_mix needs at least one source")
    if any(source.shape != sources[0].shape for source in sources):
        raise ValueError(f"attn_res_mix sources must share one shape, got {[tuple(s.shape) for s in sources]}")


def _autocast_off(device: torch.device):
    """Leave bf16 autocast for the mix (it must not downcast it); no context at all when autocast
    is off, as in fp32 training (entering one costs more than a small mix's arithmetic)."""
    return without_autocast(device) if torch.is_autocast_enabled(device.type) else contextlib.nullcontext()


def attn_res_mix(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """Mix `sources` (all of one shape `[..., d]`) with depth attention; returns `[..., d]` in the
    first source's dtype. `query` holds `d` elements: `[d]`, or the `[1, d]` projection weight
    itself (no indexing op, so no extra autograd node)."""
    _check_sources(sources)
    with _autocast_off(sources[0].device):
        return _AttnResMix.apply(norm_weight, query, eps, *sources)


def attn_res_mix_rmsnorm(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float,
    out_weight: torch.Tensor, out_eps: float,
) -> torch.Tensor:
    """`RMSNorm(attn_res_mix(sources, ...))` with gain `out_weight` (computed in fp32 or wider, cast
    back, as `k3train.model.norm.RMSNorm`); saves the sources, the mixed state and its per-token
    inverse norm, as much as a plain residual layer's RMSNorm saves."""
    _check_sources(sources)
    with _autocast_off(sources[0].device):
        return _AttnResMixRMSNorm.apply(norm_weight, query, eps, out_weight, out_eps, *sources)
