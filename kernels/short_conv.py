"""Causal depthwise short convolution followed by SiLU (the q/k/v convolutions of KDA).

For inputs `x [B, T, C]`, filters `w [C, 1, W]` (W taps, W = 4 in K3) and the last `W − 1`
inputs of the piece before, `tail [B, C, W − 1]` (zeros at the start of a sequence), with
`x_{−s}` read from the tail:

    pre_t = Σ_{s=0}^{W−1} w[:, W−1−s] ⊙ x_{t−s},     y_t = silu(pre_t) = pre_t · sigmoid(pre_t)

and the new tail is the last `W − 1` inputs (`[B, C, W − 1]`, channels first, as the cache and
context parallelism carry it).

Two forms of one definition:

- `short_conv_silu_reference`: channels first, the tail concatenated in front, `F.conv1d`
  with `groups=C` in the input's dtype, `F.silu`; autograd differentiates it. This is also
  what runs without autograd (inference, scoring): it is what the exported Hugging Face remote
  code computes, bit for bit.
- `short_conv_silu`: the training path, channels last on `[B, T, C]` as the projections
  produce it, computed in fp32 or wider (float64 stays float64) and returned in the input's
  dtype. Each tap is one shifted multiply-add over the sequence (`W` passes), the tail
  only touches the first `W − 1` positions, and the backward is written out: `∂pre` from the
  saved pre-activation with one fused `silu_backward`, `∂x` the same shifted multiply-adds run
  the other way, `∂w[:, W−1−s] = Σ_{b,t} ∂pre_t ⊙ x_{t−s}` (one reduction per tap). No
  transposes, no padded copy, no `[B, C, T]` layouts on either pass.

Over variable-length segments of one stream (`x [1, N, C]`, `cu_seqlens` as in
`kernels.segments`), each segment convolves only its own inputs, from its own tail (zeros if
none): `short_conv_silu_varlen_reference` loops over the segments; `short_conv_silu_varlen`
runs fla's varlen convolution on CUDA, elsewhere the segments packed into one padded batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.kernels.kda import fla_backend
from k3train.kernels.precision import accumulation_dtype
from k3train.kernels.segments import max_segment_length, pack_segments, unpack_segments


def _check(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None) -> int:
    if x.dim() != 3:
        raise ValueError(f"short convolution input must be [batch, seq, channels], got shape {tuple(x.shape)}")
    channels = x.shape[2]
    if weight.dim() != 3 or weight.shape[0] != channels or weight.shape[1] != 1:
        raise ValueError(
            f"short convolution weight must be [channels, 1, kernel] = [{channels}, 1, W], got {tuple(weight.shape)}"
        )
    taps = weight.shape[2]
    if tail is not None and tuple(tail.shape) != (x.shape[0], channels, taps - 1):
        raise ValueError(
            f"short convolution tail must be [batch, channels, kernel - 1] = "
            f"[{x.shape[0]}, {channels}, {taps - 1}], got {tuple(tail.shape)}"
        )
    return taps


def short_conv_silu_reference(
    x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: `x [B, T, C]`, `weight [C, 1, W]`, `tail [B, C, W − 1]` or None →
    (`silu(conv)` `[B, T, C]` in x's dtype, the last `W − 1` inputs `[B, C, W − 1]`)."""
    taps = _check(x, weight, tail)
    channels_first = x.transpose(1, 2)
    if tail is None:
        tail = channels_first.new_zeros(x.shape[0], x.shape[2], taps - 1)
    padded = torch.cat([tail.to(x.dtype), channels_first], dim=-1)
    output = F.conv1d(padded, weight.to(x.dtype), groups=x.shape[2])
    return F.silu(output).transpose(1, 2), padded[..., padded.shape[-1] - (taps - 1) :]


def _shifted_taps(
    source: torch.Tensor,
    tail: torch.Tensor | None,
    filters: torch.Tensor,
    forward: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`Σ_s filters[W−1−s] ⊙ source shifted by s` (`filters [W, C]`, each tap a contiguous row:
    a strided tap vector costs the multiply-adds their vectorisation), into `out` if given (a
    fresh full-size tensor costs more than a pass over one).

    `forward`: the convolution, shifted later in time, `tail [B, W−1, C]` (or zeros) supplying
    the inputs before the first; the taps are added oldest first, the order of `F.conv1d`'s
    sum, so the two agree to the last bit in fp32. Otherwise its transpose (the input gradient,
    shifted earlier; `tail` unused)."""
    taps, seq = filters.shape[0], source.shape[1]
    if not forward:
        result = torch.mul(source, filters[taps - 1], out=out) if out is not None else source * filters[taps - 1]
        for shift in range(1, min(taps, seq)):
            result[:, : seq - shift].addcmul_(source[:, shift:], filters[taps - 1 - shift])
        return result
    result = source.new_empty(source.shape) if out is None else out
    for shift in range(taps - 1, -1, -1):
        tap, first = filters[taps - 1 - shift], min(shift, seq)
        if shift == taps - 1:  # the oldest tap writes every position
            if shift < seq:
                torch.mul(source[:, : seq - shift], tap, out=result[:, shift:])
            if tail is None:
                result[:, :first].zero_()
            else:
                torch.mul(tail[:, :first], tap, out=result[:, :first])
            continue
        if shift < seq:
            result[:, shift:].addcmul_(source[:, : seq - shift], tap)
        if tail is not None and first:  # positions t < shift read x_{t − shift} from the tail
            result[:, :first].addcmul_(tail[:, taps - 1 - shift : taps - 1 - shift + first], tap)
    return result


class _ShortConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
        compute = accumulation_dtype(x.dtype)
        filters = weight.to(compute).reshape(weight.shape[0], weight.shape[2]).t().contiguous()  # [W, C]
        x_compute = x.to(compute)
        tail_compute = None if tail is None else tail.to(compute)
        pre = _shifted_taps(x_compute, tail_compute, filters, forward=True)
        ctx.save_for_backward(x, filters, tail, pre)
        ctx.weight_dtype = weight.dtype
        return F.silu(pre).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, filters, tail, pre = ctx.saved_tensors
        need_x, need_weight, need_tail = ctx.needs_input_grad
        grad_pre = torch.ops.aten.silu_backward(grad_output.to(pre.dtype), pre)
        taps, seq = filters.shape[0], x.shape[1]
        grad_x = grad_weight = grad_tail = None
        # one contiguous buffer: the per-tap products, then ∂x
        scratch = grad_pre.new_empty(grad_pre.shape) if need_x or need_weight else None
        if need_weight:
            assert scratch is not None  # allocated above whenever need_weight
            x_compute = x.to(pre.dtype)
            tail_compute = None if tail is None else tail.to(pre.dtype)
            grad_filters = filters.new_zeros(filters.shape)
            for shift in range(taps):
                if shift < seq:
                    # a contiguous [B, T − s, C] block of the buffer: reductions over a strided slice are slow
                    products = scratch.view(-1)[: grad_pre[:, shift:].numel()].view(grad_pre[:, shift:].shape)
                    torch.mul(grad_pre[:, shift:], x_compute[:, : seq - shift], out=products)
                    grad_filters[taps - 1 - shift] = products.sum((0, 1))
                if tail_compute is not None and shift > 0:
                    first = min(shift, seq)
                    window = tail_compute[:, taps - 1 - shift : taps - 1 - shift + first]
                    grad_filters[taps - 1 - shift] += (grad_pre[:, :first] * window).sum((0, 1))
            grad_weight = grad_filters.t().contiguous().unsqueeze(1).to(ctx.weight_dtype)
        if need_x:
            grad_x = _shifted_taps(grad_pre, None, filters, forward=False, out=scratch).to(x.dtype)
        if need_tail:
            grad_tail_compute = grad_pre.new_zeros(tail.shape)
            for shift in range(1, taps):
                first = min(shift, seq)
                grad_tail_compute[:, taps - 1 - shift : taps - 1 - shift + first].addcmul_(
                    grad_pre[:, :first], filters[taps - 1 - shift]
                )
            grad_tail = grad_tail_compute.to(tail.dtype)
        return grad_x, grad_weight, grad_tail


def short_conv_silu(
    x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The training path of `short_conv_silu_reference` (same arguments, same results). On CUDA
    with fla-core and no tail (whole sequences), fla's causal convolution with its SiLU runs
    instead (`kda.fla_backend.run_fla_short_conv_silu`: one launch forward, one backward);
    `backend="torch"` keeps the PyTorch path there too.

    Without autograd (inference, scoring) the reference runs instead: there is no backward to
    save, and its output keeps the channels-first layout whose downstream reductions (the
    q/k L2 norms) and matmuls round exactly as the exported Hugging Face remote code does, so
    `tools/score.py` and the export agree bit for bit. With autograd the output is
    channels-last; values agree with the reference's to fp32 rounding of those reductions."""
    if backend not in ("auto", "torch"):
        raise ValueError(f"short_conv_silu backend must be 'auto' or 'torch', got {backend!r}")
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, tail))):
        return short_conv_silu_reference(x, weight, tail)
    taps = _check(x, weight, tail)
    seq = x.shape[1]
    if backend == "auto" and fla_backend.use_fla_short_conv(x, tail):  # CUDA, whole sequences: fla's kernels
        output = fla_backend.run_fla_short_conv_silu(x, weight)
    else:
        tail_last = None if tail is None else tail.to(x.dtype).transpose(1, 2)  # [B, W − 1, C], a view
        output = _ShortConvSiLU.apply(x, weight, tail_last)
    if seq >= taps - 1:
        new_tail = x[:, seq - (taps - 1) :].transpose(1, 2)
    else:  # a piece shorter than the tail keeps part of the tail before it
        before = x.new_zeros(x.shape[0], x.shape[2], taps - 1) if tail is None else tail.to(x.dtype)
        new_tail = torch.cat([before[..., seq:], x.transpose(1, 2)], dim=-1)
    return output, new_tail


def short_conv_silu_varlen_reference(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, tails: torch.Tensor | None = None
) -> torch.Tensor:
    """The definition over segments: `x [1, N, C]`, `tails [S, C, W − 1]` or None (zeros) →
    `[1, N, C]`, each segment `short_conv_silu_reference` of its own tokens and tail."""
    outputs = []
    for s in range(len(cu_seqlens) - 1):
        lo, hi = int(cu_seqlens[s]), int(cu_seqlens[s + 1])
        tail = None if tails is None else tails[s : s + 1]
        outputs.append(short_conv_silu_reference(x[:, lo:hi], weight, tail)[0])
    return torch.cat(outputs, dim=1)


def short_conv_silu_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    tails: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """`short_conv_silu_varlen_reference` (same arguments and result): fla's causal convolution
    with `cu_seqlens` on CUDA without tails, else the segments packed into `[S, max_len, C]`
    and one `short_conv_silu` call (`backend` as there)."""
    if x.dim() != 3 or x.shape[0] != 1 or int(cu_seqlens[-1]) != x.shape[1]:
        raise ValueError(f"varlen short convolution takes [1, N, C] with cu_seqlens ending at N, got {tuple(x.shape)}")
    if backend == "auto" and torch.is_grad_enabled() and fla_backend.use_fla_short_conv(x, tails):
        return fla_backend.run_fla_short_conv_silu(x, weight, cu_seqlens=cu_seqlens)
    packed = pack_segments(x[0], cu_seqlens, max_segment_length(cu_seqlens))
    output, _ = short_conv_silu(packed, weight, tails, backend=backend)
    return unpack_segments(output, cu_seqlens).unsqueeze(0)
