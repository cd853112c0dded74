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
- `attn_res_mix_plain`: the definition per source with the keys given where they are, for
  `torch.compile` to fuse (`train.compile=true`).
- `block_keys`: the two-phase form. When a block representation closes, its `r_i` and its dots
  `t_ij = (γ_j ⊙ w_j)ᵀ v_i` with the score weights of every later mix `j` are computed once and
  passed to those mixes (`inverse_norms`, `dots`): a mix then
  reads a completed block only for its weighted sum and for `∂L/∂α`, adds no `r`- or
  `(γ ⊙ w)`-term to its gradient, and returns `[tokens]` vectors `∂L/∂r_i`, `∂L/∂t_ij` instead;
  autograd sums them and `block_keys`' backward applies them to the block (and to every `γ_j`,
  `w_j`) once. `key_inverse_rms` is `r_i` alone.

The backward, per token, with `t_i = (γ ⊙ w)ᵀ v_i`, `s_i = r_i t_i`, incoming gradient `g`:

    ∂L/∂α_i = gᵀ v_i,     ∂L/∂s_i = α_i (∂L/∂α_i − Σ_j α_j ∂L/∂α_j)
    ∂L/∂v_i = α_i g + (∂L/∂s_i) r_i (γ ⊙ w) − (∂L/∂s_i) s_i r_i² / d · v_i
    ∂L/∂(γ ⊙ w) = Σ_tokens Σ_i (∂L/∂s_i) r_i v_i
    (the last term of ∂L/∂v_i is ∂L/∂r_i ∂r_i/∂v_i with ∂L/∂r_i = (∂L/∂s_i) t_i, ∂r_i/∂v_i = −r_i³ v_i / d)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from k3train.kernels.precision import upcast, without_autocast


def attn_res_mix_reference(
    sources: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    query: torch.Tensor,
    eps: float,
    inverse_norms: Sequence[torch.Tensor | None] | None = None,
    dots: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The definition, stacked and differentiated by autograd; returns `[..., d]`. Takes the fast
    path's arguments, but normalises and scores every key itself (`inverse_norms` and `dots` are
    not read)."""
    with without_autocast(sources[0].device):  # bf16 autocast must not downcast the mix
        values = torch.stack([upcast(source) for source in sources], dim=-2)  # [..., sources, d]
        keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
        score_weight = upcast(norm_weight) * upcast(query).reshape(-1)
        probabilities = (keys * score_weight).sum(-1).softmax(-1)  # [..., sources]
        mixed = (probabilities.unsqueeze(-2) @ values).squeeze(-2)
    return mixed.to(sources[0].dtype)


def attn_res_mix_plain(
    sources: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    query: torch.Tensor,
    eps: float,
    inverse_norms: Sequence[torch.Tensor | None] | None = None,
    dots: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The definition per source, differentiated by autograd, reading `inverse_norms[i]` and
    `dots[i]` where given (`block_keys`): what `torch.compile` traces for `train.compile=true`
    (inductor fuses it into a few loops; no `[..., m, d]` stack). Arguments as `attn_res_mix`."""
    count = len(sources)
    inverse_norms = [None] * count if inverse_norms is None else inverse_norms
    dots = [None] * count if dots is None else dots
    with without_autocast(sources[0].device):
        values = [upcast(source) for source in sources]
        score_weight = upcast(norm_weight) * upcast(query).reshape(-1)
        scores = []
        for value, inverse_norm, dot in zip(values, inverse_norms, dots):
            if inverse_norm is None:
                inverse_norm = torch.rsqrt(value.pow(2).mean(-1) + eps)
            if dot is None:
                dot = (value * score_weight).sum(-1)
            scores.append(dot.view(value.shape[:-1]) * inverse_norm.view(value.shape[:-1]))
        probabilities = torch.stack(scores, dim=-1).softmax(-1)  # [..., sources]
        mixed = sum(probabilities[..., i, None] * value for i, value in enumerate(values))
    assert isinstance(mixed, torch.Tensor)  # sources is not empty: never the start value 0
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
    if (
        dtype in _WIDE
        and norm_weight.dtype == dtype
        and query.dtype == dtype
        and all(source.dtype == dtype for source in sources)
    ):
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


def _scores(rows: list[torch.Tensor], score_weight: torch.Tensor, eps: float, given: list, given_dots: list):
    """Weights `α`, inverse key norms `r`, scores `s` and dots `t = s / r`, each `[m, tokens]`.
    `given[i]` / `given_dots[i]`, where not None, are source i's `r` and `t` computed once for its
    block (`block_keys`)."""
    dots = torch.stack(
        [
            torch.mv(source, score_weight) if dot is None else _as(dot, score_weight.dtype)
            for source, dot in zip(rows, given_dots)
        ]
    )  # (γ ⊙ w)ᵀ v_i: no keys formed
    inverse_norm = torch.stack(
        [_inverse_rms(source, eps) if norm is None else _as(norm, dots.dtype) for source, norm in zip(rows, given)]
    )  # given: [tokens] already
    scores = dots * inverse_norm
    return scores.softmax(0), inverse_norm, scores, dots


def _weighted_sum(rows: list[torch.Tensor], probabilities: torch.Tensor) -> torch.Tensor:
    weights = probabilities.unsqueeze(-1).unbind(0)
    mixed = rows[0] * weights[0]
    for source, weight in zip(rows[1:], weights[1:]):
        mixed.addcmul_(source, weight)
    return mixed  # [tokens, d]


def _mix_backward(
    rows,
    score_weight,
    probabilities,
    inverse_norm,
    scores,
    dots,
    given,
    given_dots,
    grad_mixed,
    grad_scale,
    source_grads: bool,
    scratch: torch.Tensor | None = None,
):
    """Gradients of the sources (a list of `[tokens, d]`, or None if `not source_grads`), of
    `γ ⊙ w`, of the given inverse norms and of the given dots (lists, None where not given), from
    `∂L/∂mixed = grad_scale ⊙ grad_mixed` (`grad_scale` a per-token `[tokens]` factor or None:
    folded into the per-token scalars, so no caller spends a pass applying it). A source whose
    `r` was given gets no `r`-term here (`∂L/∂r_i = ∂L/∂s_i t_i` goes to `block_keys`, which
    applies the sum over all of a block's mixes in one pass); one whose `t` was given gets no
    `(γ ⊙ w)`-term and adds nothing to `∂L/∂(γ ⊙ w)` (`∂L/∂t_i = ∂L/∂s_i r_i` goes there too).
    `scratch`: a free `[tokens, d]` buffer for the products behind `gᵀ v_i`."""
    count, dim = len(rows), score_weight.shape[0]
    scratch = torch.empty_like(grad_mixed) if scratch is None else scratch
    grad_weights = torch.stack([torch.mul(source, grad_mixed, out=scratch).sum(-1) for source in rows])  # gᵀ v_i
    del scratch
    if grad_scale is not None:
        grad_weights.mul_(grad_scale)
    grad_scores = probabilities * (grad_weights - (probabilities * grad_weights).sum(0, keepdim=True))
    along_query = grad_scores * inverse_norm  # ∂L/∂s_i · r_i
    weights = along_query.unbind(0)
    own_dots = [i for i, dot in enumerate(given_dots) if dot is None]
    grad_score_weight = torch.zeros_like(score_weight)
    for i in own_dots:
        grad_score_weight.addmv_(rows[i].t(), weights[i])
    own_norms = [i for i, norm in enumerate(given) if norm is None]
    grad_norms: list[torch.Tensor | None] = [None] * count
    if len(own_norms) < count:  # ∂L/∂r_i = ∂L/∂s_i t_i, one op for all sources
        grad_norms = [
            None if norm is None else _as(grad, norm.dtype) for grad, norm in zip((grad_scores * dots).unbind(0), given)
        ]
    grad_dots = [None if dot is None else _as(weight, dot.dtype) for weight, dot in zip(weights, given_dots)]
    if not source_grads:
        return None, grad_score_weight, grad_norms, grad_dots
    # α_i g for every source at once; + (∂L/∂s_i r_i) (γ ⊙ w) where t_i was not given,
    # − (∂L/∂s_i s_i r_i² / d) v_i where r_i was not given.
    weights = probabilities if grad_scale is None else probabilities * grad_scale
    grads = (weights.unsqueeze(-1) * grad_mixed).unbind(0)
    for i in own_dots:
        grads[i].addr_(along_query[i], score_weight)
    for i in own_norms:
        along_value = along_query[i] * scores[i] * inverse_norm[i] / -dim  # −∂L/∂s_i · s_i r_i² / d
        grads[i].addcmul_(rows[i], along_value.unsqueeze(-1))
    return grads, grad_score_weight, grad_norms, grad_dots


def _split(tensors: tuple, given_mask: tuple) -> tuple[list, list, list]:
    """`(sources, norms, dots)` from `apply`'s flat tensors: the sources, then the given inverse
    norms, then the given dots, of the sources marked in `given_mask` (`(has_norm, has_dot)` each)."""
    count = len(given_mask)
    sources, supplied = list(tensors[:count]), iter(tensors[count:])
    norms = [next(supplied) if has_norm else None for has_norm, _ in given_mask]
    dots = [next(supplied) if has_dot else None for _, has_dot in given_mask]
    return sources, norms, dots


def _input_grads(grads, grad_norms, grad_dots, sources, given, given_dots, needs_input_grad) -> list:
    """Gradients for `apply`'s flat tensors (sources, then the given norms, then the given dots)."""
    count = len(sources)
    source_grads = (
        [None] * count
        if grads is None
        else [
            _as(grad.view(source.shape), source.dtype) if needed else None
            for grad, source, needed in zip(grads, sources, needs_input_grad[:count])
        ]
    )
    return (
        source_grads
        + [grad for grad, norm in zip(grad_norms, given) if norm is not None]
        + [grad for grad, dot in zip(grad_dots, given_dots) if dot is not None]
    )


class _AttnResMix(torch.autograd.Function):
    """`attn_res_mix` with the written-out backward; saves the sources and `[4, m, tokens]`."""

    @staticmethod
    def forward(ctx, norm_weight, query, eps, given_mask, *tensors):
        sources, given, given_dots = _split(tensors, given_mask)
        ctx.dtype = _compute_dtype(norm_weight, query, sources)
        rows = _rows(sources, ctx.dtype)
        probabilities, inverse_norm, scores, dots = _scores(
            rows, _score_weight(norm_weight, query, ctx.dtype), eps, given, given_dots
        )
        mixed = _weighted_sum(rows, probabilities)
        ctx.given_mask = given_mask
        ctx.save_for_backward(norm_weight, query, probabilities, inverse_norm, scores, dots, *tensors)
        return _as(mixed.view(sources[0].shape), sources[0].dtype)

    @staticmethod
    def backward(ctx, grad_output):
        norm_weight, query, probabilities, inverse_norm, scores, dots, *tensors = ctx.saved_tensors
        sources, given, given_dots = _split(tensors, ctx.given_mask)
        score_weight = _score_weight(norm_weight, query, ctx.dtype)
        (grad_mixed,) = _rows([grad_output], ctx.dtype)
        needs = ctx.needs_input_grad[4:]
        grads, grad_score_weight, grad_norms, grad_dots = _mix_backward(
            _rows(sources, ctx.dtype),
            score_weight,
            probabilities,
            inverse_norm,
            scores,
            dots,
            given,
            given_dots,
            grad_mixed,
            None,
            any(needs[: len(sources)]),
        )
        return (
            *_parameter_grads(ctx, norm_weight, query, grad_score_weight),
            None,
            None,
            *_input_grads(grads, grad_norms, grad_dots, sources, given, given_dots, needs),
        )


class _AttnResMixRMSNorm(torch.autograd.Function):
    """`RMSNorm(mix(sources))`. It saves what a plain RMSNorm saves (one `[tokens, d]` tensor, the
    mixed state, and the per-token inverse norm) besides the sources; backward recomputes the
    scores (a matrix–vector product and, unless given, a norm per source: cheaper than rebuilding
    the mixed state from saved weights, and no `[m, tokens]` scalars to keep)."""

    @staticmethod
    def forward(ctx, norm_weight, query, eps, out_weight, out_eps, given_mask, *tensors):
        sources, given, given_dots = _split(tensors, given_mask)
        ctx.dtype = dtype = _compute_dtype(norm_weight, query, sources)
        rows = _rows(sources, dtype)
        probabilities = _scores(rows, _score_weight(norm_weight, query, dtype), eps, given, given_dots)[0]
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
        sources, given, given_dots = _split(tensors, ctx.given_mask)
        dtype = ctx.dtype
        score_weight = _score_weight(norm_weight, query, dtype)
        rows = _rows(sources, dtype)
        probabilities, inverse_norm, scores, dots = _scores(rows, score_weight, ctx.eps, given, given_dots)
        mixed = _as(mixed, dtype)
        (grad_output,) = _rows([grad_output], dtype)
        gain = _as(out_weight, dtype)
        dim = gain.shape[0]
        # RMSNorm backward with x̂ = ρ x, ĝ = g ⊙ gain: ∂L/∂x = ρ (ĝ − x̂ · mean(ĝ ⊙ x̂)) and
        # ∂L/∂gain = Σ_tokens g ⊙ x̂; both from g ⊙ x (one pass) and two matrix–vector products.
        # ρ stays a per-token factor that the mix's backward folds into its own scalars.
        product = grad_output * mixed  # g ⊙ x
        grad_out_weight = (
            _as(torch.mv(product.t(), out_inverse_norm), out_weight.dtype) if ctx.needs_input_grad[3] else None
        )
        projection = torch.mv(product, gain).mul_(out_inverse_norm.square()).div_(-dim)  # −ρ² mean(ĝ ⊙ x)
        grad_unscaled = torch.mul(mixed, projection.unsqueeze(-1)).addcmul_(grad_output, gain)  # ∂L/∂x / ρ
        needs = ctx.needs_input_grad[6:]
        grads, grad_score_weight, grad_norms, grad_dots = _mix_backward(
            rows,
            score_weight,
            probabilities,
            inverse_norm,
            scores,
            dots,
            given,
            given_dots,
            grad_unscaled,
            out_inverse_norm,
            any(needs[: len(sources)]),
            scratch=product,
        )
        grad_norm_weight, grad_query = _parameter_grads(ctx, norm_weight, query, grad_score_weight)
        return (
            grad_norm_weight,
            grad_query,
            None,
            grad_out_weight,
            None,
            None,
            *_input_grads(grads, grad_norms, grad_dots, sources, given, given_dots, needs),
        )


class _BlockKeys(torch.autograd.Function):
    """For one block representation `v` and the score weights `γ_j ⊙ w_j` of the mixes that will
    read it: `r = (mean(v²) + ε)^{-1/2}` (`[tokens]`) and each mix's dot `t_j = (γ_j ⊙ w_j)ᵀ v`
    (the same matrix–vector product a mix would run). Backward, once per block, two matrix products:
    `∂L/∂v = Σ_j ∂L/∂t_j (γ_j ⊙ w_j) − ∂L/∂r · r³ / d · v` and `∂L/∂(γ_j ⊙ w_j) = vᵀ ∂L/∂t_j`."""

    @staticmethod
    def forward(ctx, source, eps, *parameters):
        row = _wide(source.reshape(-1, source.shape[-1]))
        inverse_norm = _inverse_rms(row, eps)
        ctx.set_materialize_grads(False)
        if not parameters:
            ctx.save_for_backward(source, inverse_norm)
            return inverse_norm
        gains, queries = parameters[0::2], parameters[1::2]
        dtype = torch.promote_types(row.dtype, _compute_dtype(gains[0], queries[0], [source]))
        score_weights = torch.stack([_score_weight(gain, query, dtype) for gain, query in zip(gains, queries)])
        # One matrix–vector product per mix, not one [J, d] × [d, tokens] product: the same op a
        # mix would run, so a score does not depend on whether its block's keys were cached.
        row = _as(row, dtype)
        dots = torch.stack([torch.mv(row, score_weight) for score_weight in score_weights])  # [J, tokens]
        ctx.dtype = dtype
        ctx.save_for_backward(source, inverse_norm, *parameters)
        return (inverse_norm, *dots.unbind(0))

    @staticmethod
    def backward(ctx, grad_inverse_norm, *grad_dots):
        source, inverse_norm, *parameters = ctx.saved_tensors
        row = _wide(source.reshape(-1, source.shape[-1]))
        grad = None
        if grad_inverse_norm is not None:
            scale = _as(grad_inverse_norm, row.dtype) * inverse_norm.pow(3) / -row.shape[-1]
            grad = row * scale.unsqueeze(-1)
        parameter_grads = [None] * len(parameters)
        if parameters and any(g is not None for g in grad_dots):
            dtype = ctx.dtype
            gains, queries = parameters[0::2], parameters[1::2]
            score_weights = torch.stack([_score_weight(gain, query, dtype) for gain, query in zip(gains, queries)])
            grad_dots = torch.stack(
                [torch.zeros_like(inverse_norm, dtype=dtype) if g is None else _as(g, dtype) for g in grad_dots]
            )  # [J, tokens]
            from_dots = torch.mm(grad_dots.t(), score_weights)  # Σ_j ∂L/∂t_j (γ_j ⊙ w_j)
            grad = _as(from_dots, row.dtype) if grad is None else grad.add_(from_dots)
            grad_score_weights = torch.mm(grad_dots, _as(row, dtype))  # [J, d]
            for j, (gain, query) in enumerate(zip(gains, queries)):
                if ctx.needs_input_grad[2 + 2 * j]:
                    parameter_grads[2 * j] = _as(grad_score_weights[j] * _wide(query).view(-1), gain.dtype)
                if ctx.needs_input_grad[3 + 2 * j]:
                    parameter_grads[2 * j + 1] = _as(grad_score_weights[j] * _wide(gain), query.dtype).view(query.shape)
        source_grad = None if grad is None else _as(grad.view(source.shape), source.dtype)
        return (source_grad, None, *parameter_grads)


def _parameter_grads(ctx, norm_weight, query, grad_score_weight):
    """`∂L/∂γ`, `∂L/∂w` from `∂L/∂(γ ⊙ w)`."""
    grad_norm_weight = (
        _as(grad_score_weight * _wide(query).view(-1), norm_weight.dtype) if ctx.needs_input_grad[0] else None
    )
    grad_query = (
        _as(grad_score_weight * _wide(norm_weight), query.dtype).view(query.shape) if ctx.needs_input_grad[1] else None
    )
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


def block_keys(
    source: torch.Tensor, eps: float, consumers: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A block representation's inverse key norm `r` (`[tokens]`, fp32 or wider) and, for each
    later mix `(norm_weight, query)` in `consumers`, its dot `(γ ⊙ w)ᵀ v` (`[tokens]`), computed
    once when the block closes. Pass them to those mixes (`inverse_norms`, `dots`): a mix then
    reads the block only for its weighted sum and its weights' gradient, and the gradients through
    `r` and the dots (`[tokens]` vectors per mix, summed by autograd) reach the block in one pass."""
    with _autocast_off(source.device):
        outputs = _BlockKeys.apply(source, eps, *(t for pair in consumers for t in pair))
    if not consumers:
        return outputs, []
    return outputs[0], list(outputs[1:])


def key_inverse_rms(source: torch.Tensor, eps: float) -> torch.Tensor:
    """`block_keys(source, eps)[0]`: the inverse key norm alone."""
    return block_keys(source, eps)[0]


def _flat(sources: Sequence[torch.Tensor], inverse_norms, dots) -> tuple[tuple, list]:
    _check_sources(sources)
    count = len(sources)
    inverse_norms = [None] * count if inverse_norms is None else list(inverse_norms)
    dots = [None] * count if dots is None else list(dots)
    if len(inverse_norms) != count or len(dots) != count:
        raise ValueError(
            f"attn_res_mix got {len(inverse_norms)} inverse_norms and {len(dots)} dots for {count} sources"
        )
    given_mask = tuple((norm is not None, dot is not None) for norm, dot in zip(inverse_norms, dots))
    return given_mask, [*sources, *(n for n in inverse_norms if n is not None), *(t for t in dots if t is not None)]


def attn_res_mix(
    sources: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    query: torch.Tensor,
    eps: float,
    inverse_norms: Sequence[torch.Tensor | None] | None = None,
    dots: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Mix `sources` (all of one shape `[..., d]`) with depth attention; returns `[..., d]` in the
    first source's dtype. `query` holds `d` elements: `[d]`, or the `[1, d]` projection weight
    itself (no indexing op, so no extra autograd node). `inverse_norms[i]` and `dots[i]`, where
    given, come from `block_keys(sources[i], eps, [..., (norm_weight, query), ...])`."""
    given_mask, tensors = _flat(sources, inverse_norms, dots)
    with _autocast_off(sources[0].device):
        return _AttnResMix.apply(norm_weight, query, eps, given_mask, *tensors)


def attn_res_mix_rmsnorm(
    sources: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    query: torch.Tensor,
    eps: float,
    out_weight: torch.Tensor,
    out_eps: float,
    inverse_norms: Sequence[torch.Tensor | None] | None = None,
    dots: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """`RMSNorm(attn_res_mix(sources, ...))` with gain `out_weight` (computed in fp32 or wider, cast
    back, as `k3train.model.norm.RMSNorm`); saves the sources, the mixed state and its per-token
    inverse norm, as much as a plain residual layer's RMSNorm saves."""
    given_mask, tensors = _flat(sources, inverse_norms, dots)
    with _autocast_off(sources[0].device):
        return _AttnResMixRMSNorm.apply(norm_weight, query, eps, out_weight, out_eps, given_mask, *tensors)
