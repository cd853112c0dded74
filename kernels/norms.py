"""Normalisations over the last dim with written-out backwards: the L2 normalisation of KDA's
queries and keys, the gated RMSNorm of its output, and the RMSNorm of every `RMSNorm` module
(`k3train/model/norm.py`: pre-norms, latent norms, the final norm).

Each has its definition in plain PyTorch (`*_reference`, differentiated by autograd) and a
training path (an `autograd.Function`) that saves the normalised values and the per-row inverse
norm instead of autograd's chain of intermediates, and computes the gradient in a few fused
passes. With `y = x · r` and the per-row scalar `r = (Σx² / n + ε)^{-1/2}` (n = 1 for the L2 form,
the row length for the RMS form), the input gradient is

    ∂L/∂x = (∂L/∂y − y · Σ(∂L/∂y ⊙ y) / n) · r

(the one-row Jacobian `r (I − y yᵀ / n)`). Both compute in fp32 or wider (float64 stays float64)
and return the input's dtype.
"""

from __future__ import annotations

import torch

from k3train.kernels.kda import fla_backend
from k3train.kernels.precision import accumulation_dtype, upcast


def l2_normalize_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(Σx² + eps)` over the last dim, in fp32: FLA's `l2norm` (what its KDA kernel and
    transformers' Kimi Linear compute), not `F.normalize`'s `x / max(‖x‖, eps)`, which differs
    by ~eps/(2‖x‖²) relative: 1e-4 for the small q/k of a freshly initialised model."""
    x32 = upcast(x)
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _normalize(x: torch.Tensor, eps: float, mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(x · r, r)` with `r = (Σx² (/ n) + eps)^{-1/2}` over the last dim (keepdim), summed as
    the references sum it (`pow(2).sum`/`.mean`: the same bits; `vector_norm(x)²` saves a pass
    but rounds differently, enough to flip a near-tied expert choice downstream). `x · r` reuses
    the squares' buffer (x's layout): one full-size allocation."""
    squares = x.pow(2)
    sums = squares.mean(-1, keepdim=True) if mean else squares.sum(-1, keepdim=True)
    inverse_norm = sums.add_(eps).rsqrt_()
    return torch.mul(x, inverse_norm, out=squares), inverse_norm


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        x_compute = x.to(accumulation_dtype(x.dtype))
        normalized, inverse_norm = _normalize(x_compute, eps, mean=False)
        ctx.save_for_backward(normalized, inverse_norm)
        ctx.input_dtype = x.dtype
        return normalized.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        normalized, inverse_norm = ctx.saved_tensors
        grad = grad_output.to(normalized.dtype)
        # The one full-size allocation, reused for ∂x; `normalized` first: the result takes its
        # (contiguous) layout whatever the incoming gradient's, so the views before need no copy.
        products = normalized * grad
        projection = products.sum(-1, keepdim=True)
        grad_x = torch.addcmul(grad, normalized, projection, value=-1, out=products).mul_(inverse_norm)
        return grad_x.to(ctx.input_dtype), None


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The training path of `l2_normalize_reference` (same arguments, same result)."""
    return _L2Normalize.apply(x, eps)


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm(x) · weight · sigmoid(gate)` over the last dim, in fp32, returned in x's dtype
    (KDA's output norm: `x`, `gate` `[..., D]`, `weight` `[D]`)."""
    x32 = upcast(x)
    normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normalized * upcast(weight) * torch.sigmoid(upcast(gate))).to(x.dtype)


class _GatedRMSNorm(torch.autograd.Function):
    """Backward with `n = x·r`, `s = sigmoid(gate)`, `a = ∂L/∂out ⊙ s`, `q = a ⊙ n ⊙ weight`:
    `∂L/∂weight = Σ a ⊙ n`, `∂L/∂gate = q (1 − s)`, `∂L/∂x = (a ⊙ weight − n · mean(q)) · r`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        compute = accumulation_dtype(torch.promote_types(torch.promote_types(x.dtype, gate.dtype), weight.dtype))
        x_compute, weight_compute = x.to(compute), weight.to(compute)
        normalized, inverse_norm = _normalize(x_compute, eps, mean=True)
        gate_sigmoid = torch.sigmoid(gate.to(compute))
        # contiguous whatever x's layout: the output feeds a reshape to the output projection
        output = torch.mul(normalized, weight_compute, out=normalized.new_empty(x.shape)).mul_(gate_sigmoid)
        ctx.save_for_backward(normalized, gate_sigmoid, inverse_norm, weight_compute)
        ctx.dtypes = (x.dtype, gate.dtype, weight.dtype)
        return output.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        normalized, gate_sigmoid, inverse_norm, weight = ctx.saved_tensors
        need_x, need_gate, need_weight, _ = ctx.needs_input_grad
        x_dtype, gate_dtype, weight_dtype = ctx.dtypes
        gated = gate_sigmoid * grad_output.to(normalized.dtype)  # a, in the saved tensors' layout
        gated_normalized = normalized * gated  # a ⊙ n
        grad_x = grad_gate = grad_weight = None
        if need_weight:
            grad_weight = gated_normalized.reshape(-1, weight.shape[0]).sum(0).to(weight_dtype)
        if need_x or need_gate:  # in place from here: a fresh full-size tensor costs more than a pass
            q = gated_normalized.mul_(weight)
            if need_x:
                grad_x = gated.mul_(weight).addcmul_(normalized, q.mean(-1, keepdim=True), value=-1)
                grad_x = grad_x.mul_(inverse_norm).to(x_dtype)
            if need_gate:
                grad_gate = q.addcmul_(q, gate_sigmoid, value=-1).to(gate_dtype)
        return grad_x, grad_gate, grad_weight, None


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto"
) -> torch.Tensor:
    """The training path of `gated_rms_norm_reference` (same arguments, same result). On CUDA
    with fla-core, fla's fused kernel (`kda.fla_backend.run_fla_gated_rms_norm`: one launch
    forward, one backward) unless `backend="torch"` or inside `torch.compile`."""
    if backend not in ("auto", "torch"):
        raise ValueError(f"gated_rms_norm backend must be 'auto' or 'torch', got {backend!r}")
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"gated RMSNorm needs gate of x's shape {tuple(x.shape)} and weight [{x.shape[-1]}], "
            f"got gate {tuple(gate.shape)} and weight {tuple(weight.shape)}"
        )
    # (Under `torch.compile`, `train.compile`'s norms region, inductor fuses the PyTorch path.)
    if backend == "auto" and not torch.compiler.is_compiling() and fla_backend.use_fla_gated_norm(x, gate):
        return fla_backend.run_fla_gated_rms_norm(x, gate, weight, eps)
    return _GatedRMSNorm.apply(x, gate, weight, eps)


# RMSNorm with a gain: `w ⊙ x · r`, r = (mean(x²) + eps)^{-1/2}. Its backward, with `P = G·n`
# (which gives `∂w = Σ_rows P` and the row dot `Σ_j P·w` by a matrix-vector product), is
# `∂x = r·(G·w − n·Σ_j(P·w)/d)`, written into P's buffer: 6 passes, one new tensor (autograd over
# the formula: ~11 passes).
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The definition, differentiated by autograd (`model/norm.py`'s `RMSNorm.forward`)."""
    x32 = upcast(x)
    normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (upcast(weight) * normalized).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = accumulation_dtype(x.dtype)
        x32, weight32 = x.to(dtype), weight.to(dtype)
        normalized, rstd = _normalize(x32, eps, mean=True)
        ctx.save_for_backward(normalized, rstd, weight32)
        ctx.dtypes = x.dtype, weight.dtype
        return (normalized * weight32).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        normalized, rstd, weight32 = ctx.saved_tensors
        x_dtype, weight_dtype = ctx.dtypes
        grad = grad_out.to(normalized.dtype)
        products = grad * normalized  # P = G·n
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = products.reshape(-1, products.shape[-1]).sum(0).to(weight_dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # Σ_j G·w·n / d per row; then P's buffer takes G·w − n·that, times r
            row_dot = products.reshape(-1, products.shape[-1]).mv(weight32) / products.shape[-1]
            grad_x = torch.mul(grad, weight32, out=products)
            torch.addcmul(grad_x, normalized, row_dot.view(rstd.shape), value=-1.0, out=grad_x)
            grad_x = grad_x.mul_(rstd).to(x_dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_reference` with a closed-form backward where autograd records; the formula itself
    (its operation order: the exported remote code's) without autograd or under `torch.compile`."""
    records = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if torch.compiler.is_compiling() or not records:
        return rms_norm_reference(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)
