"""RMSNorm with a closed-form backward: `w ⊙ x / sqrt(mean(x²) + eps)` over the last dim, in fp32
(float64 stays float64), returned in the input dtype, as `model/norm.py`'s module computes it.

Autograd over that formula (`rms_norm_reference`) runs ~5 passes over `x`-sized tensors forward
and ~11 backward (the square's, the mean's and both products' derivatives, an accumulation).
`rms_norm` is one autograd function: forward a norm (one read), `n = x·r` and `n·w`; backward,
with `P = G·n` (which gives `∂w = Σ_rows P` and the row dot `Σ_j P·w` by a matrix-vector product),
`∂x = r·(G·w − n·Σ_j(P·w)/d)` written into P's buffer: 6 passes, one new tensor.
"""

import torch

from k3train.kernels.precision import accumulation_dtype, upcast


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
        width = x.shape[-1]
        norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)  # one read: sqrt(Σ x²)
        rstd = norm.square_().div_(width).add_(eps).rsqrt_()
        normalized = x32 * rstd
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
            row_dot = (products.reshape(-1, products.shape[-1]).mv(weight32) / products.shape[-1])
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
