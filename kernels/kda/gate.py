"""KDA decay gates: map the raw gate projection `z` to the log-space decay `g` the kernels take.

Both follow flash-linear-attention's reference gates (`fla/ops/kda/gate.py`): `A_log` is one
learned scalar per head, `dt_bias` one learned bias per head and key channel (stored flat as
`[H * K]`, as in the checkpoint).

Each gate has its definition (`*_reference`, differentiated by autograd) and a training path
with the backward written out (an `autograd.Function` saving the input and the output, no
intermediates). With `a = exp(A_log)`, `u = z + dt_bias`, incoming gradient `∂g`:

- bounded, `g = λ·sigmoid(a·u)` (λ the lower bound): `e = ∂g ⊙ g ⊙ (1 − g/λ)` (= `∂g·λ·σ(1−σ)`),
  `∂z = a·e`, `∂dt_bias = Σ_{B,T} a·e`, `∂A_log = Σ_{B,T,K} e ⊙ a·u`;
- unbounded, `g = −a·softplus(u)`: `∂z = −a·∂g ⊙ sigmoid(u)`, `∂dt_bias = Σ_{B,T} ∂z`,
  `∂A_log = Σ_{B,T,K} ∂g ⊙ g`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.kernels.precision import upcast


def _gate_argument(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(exp(A_log)` as `[H, 1]`, `z + dt_bias` as `[B, T, H, K])`, both in fp32 (float64
    inputs stay float64, so tests can hold implementations together to 1e-12)."""
    _gate_argument_shapes(z, A_log, dt_bias)
    heads, key_dim = z.shape[-2:]
    head_rate = upcast(A_log).exp().unsqueeze(-1)  # broadcast over the K channels of each head
    shifted = upcast(z) + upcast(dt_bias).reshape(heads, key_dim)
    return head_rate, shifted


def _gate_argument_shapes(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    heads, key_dim = z.shape[-2:]
    if A_log.shape != (heads,):
        raise ValueError(f"A_log must have shape [H] = [{heads}], got {tuple(A_log.shape)}")
    if dt_bias.shape != (heads * key_dim,):
        raise ValueError(f"dt_bias must have shape [H*K] = [{heads * key_dim}], got {tuple(dt_bias.shape)}")


def kda_gate_reference(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0
) -> torch.Tensor:
    """K3's bounded gate: `g = lower_bound · sigmoid(exp(A_log) · (z + dt_bias))`.

    The decay per token stays above `lower_bound` (docs/design.md §1.1: −5 in K3), which is what keeps the
    chunkwise kernel's tiles in range. In exact arithmetic `g ∈ (lower_bound, 0)`; in fp32 the
    sigmoid saturates for |argument| ≳ 17 (upper end) and ≳ 88 (lower end), so extreme inputs
    reach the closed ends.

    Args:
        z: raw gate `[B, T, H, K]` (any float dtype).
        A_log: `[H]`, log of the per-head rate.
        dt_bias: `[H * K]`, per-channel bias.
        lower_bound: the most negative decay per token (< 0).

    Returns:
        `g`, `[B, T, H, K]` in fp32 (float64 for float64 inputs).
    """
    if not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    head_rate, shifted = _gate_argument(z, A_log, dt_bias)
    return lower_bound * torch.sigmoid(head_rate * shifted)


def kda_gate_unbounded_reference(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's gate: `g = −exp(A_log) · softplus(z + dt_bias)` (≤ 0, no lower bound).

    Args and return as `kda_gate_reference`.
    """
    head_rate, shifted = _gate_argument(z, A_log, dt_bias)
    return -head_rate * F.softplus(shifted)


def _sum_to_heads(values: torch.Tensor) -> torch.Tensor:
    """`[..., H, K]` summed over the leading dims → `[H, K]` (no reshape: it would copy a strided input)."""
    return values.sum(tuple(range(values.dim() - 2)))


class _BoundedGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
        heads, key_dim = z.shape[-2:]
        z_compute = upcast(z)
        head_rate = upcast(A_log).exp().unsqueeze(-1)  # [H, 1]
        shift = upcast(dt_bias).reshape(heads, key_dim)
        # in place after the one allocation, in the reference's order (the same bits)
        gate = torch.add(z_compute, shift).mul_(head_rate).sigmoid_().mul_(lower_bound)
        ctx.save_for_backward(z_compute, gate, head_rate, shift)
        ctx.lower_bound = lower_bound
        ctx.dtypes = (z.dtype, A_log.dtype, dt_bias.dtype)
        return gate

    @staticmethod
    def backward(ctx, grad_gate: torch.Tensor):
        z, gate, head_rate, shift = ctx.saved_tensors
        need_z, need_a, need_bias, _ = ctx.needs_input_grad
        z_dtype, a_dtype, bias_dtype = ctx.dtypes
        # Two full-size allocations (each costs more than a pass): e, and the product e ⊙ z whose
        # buffer then takes ∂z.
        argument_grad = gate * grad_gate.to(gate.dtype)  # gate first: the result takes its (contiguous) layout
        argument_grad.addcmul_(argument_grad, gate, value=-1.0 / ctx.lower_bound)  # e
        grad_z = grad_a = grad_bias = None
        products = None
        if need_a or need_bias:
            summed = _sum_to_heads(argument_grad)  # Σ_{B,T} e: [H, K]
            if need_bias:
                grad_bias = (summed * head_rate).reshape(-1).to(bias_dtype)
            if need_a:
                products = argument_grad * z
                along_z = _sum_to_heads(products).sum(-1)
                grad_a = (head_rate.squeeze(-1) * (along_z + (summed * shift).sum(-1))).to(a_dtype)
        if need_z:
            grad_z = (
                torch.mul(argument_grad, head_rate, out=products)
                if products is not None
                else argument_grad.mul_(head_rate)
            )
            grad_z = grad_z.to(z_dtype)
        return grad_z, grad_a, grad_bias, None


class _UnboundedGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        head_rate, shifted = _gate_argument(z, A_log, dt_bias)
        gate = F.softplus(shifted).mul_(-head_rate)
        ctx.save_for_backward(shifted, gate, head_rate)
        ctx.dtypes = (z.dtype, A_log.dtype, dt_bias.dtype)
        return gate

    @staticmethod
    def backward(ctx, grad_gate: torch.Tensor):
        shifted, gate, head_rate = ctx.saved_tensors
        need_z, need_a, need_bias = ctx.needs_input_grad
        z_dtype, a_dtype, bias_dtype = ctx.dtypes
        grad = grad_gate.to(gate.dtype)
        grad_z = grad_a = grad_bias = None
        if need_z or need_bias:
            grad_shifted = torch.sigmoid(shifted).mul_(grad).mul_(-head_rate)
            if need_bias:
                grad_bias = _sum_to_heads(grad_shifted).reshape(-1).to(bias_dtype)
            if need_z:
                grad_z = grad_shifted.to(z_dtype)
        if need_a:
            grad_a = _sum_to_heads(grad * gate).sum(-1).to(a_dtype)
        return grad_z, grad_a, grad_bias


def kda_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0) -> torch.Tensor:
    """The training path of `kda_gate_reference` (same arguments, same result; the backward
    written out): `g = lower_bound · sigmoid(exp(A_log) · (z + dt_bias))`, `[B, T, H, K]` in fp32
    (float64 for float64 inputs)."""
    if not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    _gate_argument_shapes(z, A_log, dt_bias)
    return _BoundedGate.apply(z, A_log, dt_bias, lower_bound)


def kda_gate_unbounded(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """The training path of `kda_gate_unbounded_reference`: `g = −exp(A_log) · softplus(z + dt_bias)`."""
    _gate_argument_shapes(z, A_log, dt_bias)
    return _UnboundedGate.apply(z, A_log, dt_bias)
