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
  (below), so no `[tokens, m, d]` stack exists. With the output RMSNorm fused
  (`attn_res_mix_rmsnorm`, the sublayer's input under `recompute: attn_res`), a mix saves what a
  plain RMSNorm saves (the mixed state and its inverse norm) besides the sources, and backward
  recomputes the `[m, tokens]` scores (one matrix–vector product per source) instead of keeping
  them.
- `key_inverse_rms`: `r_i` of one source, computed once when a block representation closes and
  passed to every later mix (`inverse_norms`): a mix then neither reads the block for its norm
  nor applies the norm's gradient term to it; `∂L/∂r_i` (a `[tokens]` vector per mix) sums in
  autograd and the norm's backward applies it to the block once.

The backward, per token, with `t_i = (γ ⊙ w)ᵀ v_i`, `s_i = r_i t_i`, incoming gradient `g`:

    ∂L/∂α_i = gᵀ v_i,     ∂L/∂s_i = α_i (∂L/∂α_i − Σ_j α_j ∂L/∂α_j)
    ∂L/∂v_i = α_i g + (∂L/∂s_i) r_i (γ ⊙ w) − (∂L/∂s_i) s_i r_i² / d · v_i
    ∂L/∂(γ ⊙ w) = Σ_tokens Σ_i (∂L/∂s_i) r_i v_i
    (the last term of ∂L/∂v_i is ∂L/∂r_i ∂r_i/∂v_i with ∂L/∂r_i = (∂L/∂s_i) t_i, ∂r_i/∂v_i = −r_i³ v_i / d)
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from k3train.kernels.precision import upcast, without_autocast


def attn_res_mix_reference(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float,
    inverse_norms: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> torch.Tensor:
    """The definition, stacked and differentiated by autograd; returns `[..., d]`. Takes the fast
    path's arguments, but normalises every key itself (`inverse_norms` is not read)."""
    with without_autocast(sources[0].device):  # bf16 autocast must not downcast the mix
        values = torch.stack([upcast(source) for source in sources], dim=-2)  # [..., sources, d]
        keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
        score_weight = upcast(norm_weight) * upcast(query).reshape(-1)
        probabilities = (keys * score_weight).sum(-1).softmax(-1)  # [..., sources]
        mixed = (probabilities.unsqueeze(-2) @ values).squeeze(-2)
    return mixed.to(sources[0].dtype)


_WIDE = (torch.float32, torch.float64)


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """`upcast` without its dtype promotion call (the mix runs it a few dozen times per call)."""
    return tensor if tensor.dtype in _WIDE else tensor.float()


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _compute_dtype(norm_weight: torch.Tensor, query: torch.Tensor, sources: Sequence[torch.Tensor]) -> torch.dtype:
    """fp32 or wider, and no narrower than any source or parameter (under bf16 autocast the
    embedding's fp32 output meets bf16 sublayer outputs)."""
    dtype = sources[0].dtype
    if dtype in _WIDE and norm_weight.dtype == dtype and query.dtype == dtype and all(
            source.dtype == dtype for source in sources):
        return dtype
    dtype = torch.promote_types(_wide(norm_weight).dtype, query.dtype)
    for source_dtype in {source.dtype for source in sources}:
        dtype = torch.promote_types(dtype, source_dtype)
    return dtype


def _score_weight(norm_weight: torch.Tensor, query: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`γ ⊙ w` (`[d]`) in the computation's dtype."""
    return _as(norm_weight, dtype) * _as(query, dtype).view(-1)


def _rows(sources: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each `[..., d]` source as `[tokens, d]` in the accumulation dtype (views for fp32/fp64)."""
    return [_as(source.reshape(-1, source.shape[-1]), dtype) for source in sources]


def _inverse_rms(row: torch.Tensor, eps: float) -> torch.Tensor:
    """`(mean(v²) + ε)^{-1/2}` per row of `[tokens, d]`: one read of the row."""
    return torch.linalg.vector_norm(row, dim=-1).square_().div_(row.shape[-1]).add_(eps).rsqrt_()


def _scores(rows: list[torch.Tensor], score_weight: torch.Tensor, eps: float, given: list):
    """Weights `α`, inverse key norms `r`, scores `s` and dots `t = s / r`, each `[m, tokens]`;
    `given[i]`, if not None, is source i's `r` computed once by `key_inverse_rms`."""
    dots = torch.stack([torch.mv(source, score_weight) for source in rows])  # (γ ⊙ w)ᵀ v_i: no keys formed
    inverse_norm = torch.stack([_inverse_rms(source, eps) if norm is None else _as(norm, dots.dtype)
                                for source, norm in zip(rows, given)])  # given: [tokens] already
    scores = dots * inverse_norm
    return scores.softmax(0), inverse_norm, scores, dots


def _weighted_sum(rows: list[torch.Tensor], probabilities: torch.Tensor) -> torch.Tensor:
    weights = probabilities.unsqueeze(-1).unbind(0)
    mixed = rows[0] * weights[0]
    for source, weight in zip(rows[1:], weights[1:]):
        mixed.addcmul_(source, weight)
    return mixed  # [tokens, d]


def _mix_backward(rows, score_weight, probabilities, inverse_norm, scores, dots, given, grad_mixed, grad_scale,
                  source_grads: bool, scratch: Optional[torch.Tensor] = None):
    """Gradients of the sources (a list of `[tokens, d]`, or None if `not source_grads`), of
    `γ ⊙ w` and of the given inverse norms (a list, None where not given), from
    `∂L/∂mixed = grad_scale ⊙ grad_mixed` (`grad_scale` a per-token `[tokens]` factor or None:
    folded into the per-token scalars, so no caller spends a pass applying it). A source whose
    `r` was given gets no `r`-term here: `∂L/∂r_i = ∂L/∂s_i t_i` goes to `key_inverse_rms`, which
    applies the sum over all of a block's mixes in one pass. `scratch`: a free `[tokens, d]`
    buffer for the products behind `gᵀ v_i` (one buffer, warm in cache, for every source)."""
    count, dim = len(rows), score_weight.shape[0]
    scratch = torch.empty_like(grad_mixed) if scratch is None else scratch
    grad_weights = torch.stack([torch.mul(source, grad_mixed, out=scratch).sum(-1) for source in rows])  # gᵀ v_i
    del scratch
    if grad_scale is not None:
        grad_weights.mul_(grad_scale)
    grad_scores = probabilities * (grad_weights - (probabilities * grad_weights).sum(0, keepdim=True))
    along_query = grad_scores * inverse_norm  # ∂L/∂s_i · r_i
    weights = along_query.unbind(0)
    grad_score_weight = torch.mv(rows[0].t(), weights[0])
    for source, weight in zip(rows[1:], weights[1:]):
        grad_score_weight.addmv_(source.t(), weight)
    computed = [i for i, norm in enumerate(given) if norm is None]
    grad_norms = [None] * count
    if len(computed) < count:  # ∂L/∂r_i = ∂L/∂s_i t_i, one op for all sources
        grad_norms = [None if norm is None else _as(grad, norm.dtype)
                      for grad, norm in zip((grad_scores * dots).unbind(0), given)]
    if not source_grads:
        return None, grad_score_weight, grad_norms
    # α_i g + (∂L/∂s_i r_i) (γ ⊙ w) for every source at once, then − (∂L/∂s_i s_i r_i² / d) v_i
    # for the sources whose r was not given.
    weights = probabilities if grad_scale is None else probabilities * grad_scale
    grads = weights.unsqueeze(-1) * grad_mixed
    grads.baddbmm_(along_query.unsqueeze(-1), score_weight.expand(count, 1, dim))
    grads = grads.unbind(0)
    for i in computed:
        along_value = along_query[i] * scores[i] * inverse_norm[i] / -dim  # −∂L/∂s_i · s_i r_i² / d
        grads[i].addcmul_(rows[i], along_value.unsqueeze(-1))
    return grads, grad_score_weight, grad_norms


def _split(tensors: tuple, given_mask: tuple) -> tuple[list, list]:
    """`(sources, given)` from `apply`'s flat tensors: the sources, then the given inverse norms
    of the sources marked in `given_mask`."""
    count = len(given_mask)
    sources, supplied = list(tensors[:count]), iter(tensors[count:])
    return sources, [next(supplied) if marked else None for marked in given_mask]


def _input_grads(grads, grad_norms, sources, given, needs_input_grad) -> list:
    """Gradients for `apply`'s flat tensors (sources, then the given norms)."""
    count = len(sources)
    source_grads = ([None] * count if grads is None else
                    [_as(grad.view(source.shape), source.dtype) if needed else None
                     for grad, source, needed in zip(grads, sources, needs_input_grad[:count])])
    return source_grads + [grad for grad, norm in zip(grad_norms, given) if norm is not None]


class _AttnResMix(torch.autograd.Function):
    """`attn_res_mix` with the written-out backward; saves the sources and `[4, m, tokens]`."""

    @staticmethod
    def forward(ctx, norm_weight, query, eps, given_mask, *tensors):
        sources, given = _split(tensors, given_mask)
        ctx.dtype = _compute_dtype(norm_weight, query, sources)
        rows = _rows(sources, ctx.dtype)
        probabilities, inverse_norm, scores, dots = _scores(rows, _score_weight(norm_weight, query, ctx.dtype), eps,
                                                            given)
        mixed = _weighted_sum(rows, probabilities)
        ctx.given_mask = given_mask
        ctx.save_for_backward(norm_weight, query, probabilities, inverse_norm, scores, dots, *tensors)
        return _as(mixed.view(sources[0].shape), sources[0].dtype)

    @staticmethod
    def backward(ctx, grad_output):
        norm_weight, query, probabilities, inverse_norm, scores, dots, *tensors = ctx.saved_tensors
        sources, given = _split(tensors, ctx.given_mask)
        score_weight = _score_weight(norm_weight, query, ctx.dtype)
        (grad_mixed,) = _rows([grad_output], ctx.dtype)
        needs = ctx.needs_input_grad[4:]
        grads, grad_score_weight, grad_norms = _mix_backward(
            _rows(sources, ctx.dtype), score_weight, probabilities, inverse_norm, scores, dots, given,
            grad_mixed, None, any(needs[:len(sources)]))
        return (*_parameter_grads(ctx, norm_weight, query, grad_score_weight), None, None,
                *_input_grads(grads, grad_norms, sources, given, needs))


class _AttnResMixRMSNorm(torch.autograd.Function):
    """`RMSNorm(mix(sources))`. It saves what a plain RMSNorm saves (one `[tokens, d]` tensor, the
    mixed state, and the per-token inverse norm) besides the sources; backward recomputes the
    scores (a matrix–vector product and, unless given, a norm per source: cheaper than rebuilding
    the mixed state from saved weights, and no `[m, tokens]` scalars to keep)."""

    @staticmethod
    def forward(ctx, norm_weight, query, eps, out_weight, out_eps, given_mask, *tensors):
        sources, given = _split(tensors, given_mask)
        ctx.dtype = dtype = _compute_dtype(norm_weight, query, sources)
        rows = _rows(sources, dtype)
        probabilities = _scores(rows, _score_weight(norm_weight, query, dtype), eps, given)[0]
        # Rounded to the sources' dtype, as `RMSNorm(attn_res_mix(...))` would see it.
        mixed = _as(_weighted_sum(rows, probabilities), sources[0].dtype)
        wide = _wide(mixed)
        out_inverse_norm = _inverse_rms(wide, out_eps)
        output = (wide * out_inverse_norm.unsqueeze(-1)).mul_(_wide(out_weight))
        ctx.eps, ctx.given_mask = eps, given_mask
        ctx.save_for_backward(norm_weight, query, out_weight, out_inverse_norm, mixed, *tensors)
        return _as(output, sources[0].dtype).view(sources[0].shape)

    @staticmethod
    def backward(ctx, grad_output):
        norm_weight, query, out_weight, out_inverse_norm, mixed, *tensors = ctx.saved_tensors
        sources, given = _split(tensors, ctx.given_mask)
        dtype = ctx.dtype
        score_weight = _score_weight(norm_weight, query, dtype)
        rows = _rows(sources, dtype)
        probabilities, inverse_norm, scores, dots = _scores(rows, score_weight, ctx.eps, given)
        mixed = _as(mixed, dtype)
        (grad_output,) = _rows([grad_output], dtype)
        gain = _as(out_weight, dtype)
        dim = gain.shape[0]
        # RMSNorm backward with x̂ = ρ x, ĝ = g ⊙ gain: ∂L/∂x = ρ (ĝ − x̂ · mean(ĝ ⊙ x̂)) and
        # ∂L/∂gain = Σ_tokens g ⊙ x̂; both from g ⊙ x (one pass) and two matrix–vector products.
        # ρ stays a per-token factor that the mix's backward folds into its own scalars.
        product = grad_output * mixed  # g ⊙ x
        grad_out_weight = (_as(torch.mv(product.t(), out_inverse_norm), out_weight.dtype)
                           if ctx.needs_input_grad[3] else None)
        projection = torch.mv(product, gain).mul_(out_inverse_norm.square()).div_(-dim)  # −ρ² mean(ĝ ⊙ x)
        grad_unscaled = torch.mul(mixed, projection.unsqueeze(-1)).addcmul_(grad_output, gain)  # ∂L/∂x / ρ
        needs = ctx.needs_input_grad[6:]
        grads, grad_score_weight, grad_norms = _mix_backward(
            rows, score_weight, probabilities, inverse_norm, scores, dots, given, grad_unscaled, out_inverse_norm,
            any(needs[:len(sources)]), scratch=product)
        grad_norm_weight, grad_query = _parameter_grads(ctx, norm_weight, query, grad_score_weight)
        return (grad_norm_weight, grad_query, None, grad_out_weight, None, None,
                *_input_grads(grads, grad_norms, sources, given, needs))


class _KeyInverseRMS(torch.autograd.Function):
    """`r = (mean(v²) + ε)^{-1/2}` per token of one source (`[tokens]`, fp32 or wider). Backward:
    `∂L/∂v = −∂L/∂r · r³ / d · v`, one pass for the gradients of every mix that used `r`."""

    @staticmethod
    def forward(ctx, source, eps):
        inverse_norm = _inverse_rms(_wide(source.reshape(-1, source.shape[-1])), eps)
        ctx.save_for_backward(source, inverse_norm)
        return inverse_norm

    @staticmethod
    def backward(ctx, grad_inverse_norm):
        source, inverse_norm = ctx.saved_tensors
        row = _wide(source.reshape(-1, source.shape[-1]))
        scale = _as(grad_inverse_norm, row.dtype) * inverse_norm.pow(3) / -row.shape[-1]
        return _as((row * scale.unsqueeze(-1)).view(source.shape), source.dtype), None


def _parameter_grads(ctx, norm_weight, query, grad_score_weight):
    """`∂L/∂γ`, `∂L/∂w` from `∂L/∂(γ ⊙ w)`."""
    grad_norm_weight = (_as(grad_score_weight * _wide(query).view(-1), norm_weight.dtype)
                        if ctx.needs_input_grad[0] else None)
    grad_query = (_as(grad_score_weight * _wide(norm_weight), query.dtype).view(query.shape)
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


def key_inverse_rms(source: torch.Tensor, eps: float) -> torch.Tensor:
    """A source's inverse key norm `r` (`[tokens]`, fp32 or wider), computed once for a block
    representation that many mixes read: pass it to them in `inverse_norms`, and the key norm's
    backward runs once per block instead of once per mix."""
    with _autocast_off(source.device):
        return _KeyInverseRMS.apply(source, eps)


def _flat(sources: Sequence[torch.Tensor], inverse_norms) -> tuple[tuple, list]:
    _check_sources(sources)
    if inverse_norms is None:
        return (False,) * len(sources), list(sources)
    if len(inverse_norms) != len(sources):
        raise ValueError(f"attn_res_mix got {len(inverse_norms)} inverse_norms for {len(sources)} sources")
    given_mask = tuple(norm is not None for norm in inverse_norms)
    return given_mask, [*sources, *(norm for norm in inverse_norms if norm is not None)]


def attn_res_mix(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float,
    inverse_norms: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> torch.Tensor:
    """Mix `sources` (all of one shape `[..., d]`) with depth attention; returns `[..., d]` in the
    first source's dtype. `query` holds `d` elements: `[d]`, or the `[1, d]` projection weight
    itself (no indexing op, so no extra autograd node). `inverse_norms[i]`, where given, is
    `key_inverse_rms(sources[i], eps)`."""
    given_mask, tensors = _flat(sources, inverse_norms)
    with _autocast_off(sources[0].device):
        return _AttnResMix.apply(norm_weight, query, eps, given_mask, *tensors)


def attn_res_mix_rmsnorm(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float,
    out_weight: torch.Tensor, out_eps: float, inverse_norms: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> torch.Tensor:
    """`RMSNorm(attn_res_mix(sources, ...))` with gain `out_weight` (computed in fp32 or wider, cast
    back, as `k3train.model.norm.RMSNorm`); saves the sources, the mixed state and its per-token
    inverse norm, as much as a plain residual layer's RMSNorm saves."""
    given_mask, tensors = _flat(sources, inverse_norms)
    with _autocast_off(sources[0].device):
        return _AttnResMixRMSNorm.apply(norm_weight, query, eps, out_weight, out_eps, given_mask, *tensors)
