"""KDA decay gates: map the raw gate projection `z` to the log-space decay `g` the kernels take.

Both follow flash-linear-attention's reference gates (`fla/ops/kda/gate.py`): `A_log` is one
learned scalar per head, `dt_bias` one learned bias per head and key channel (stored flat as
`[H * K]`, as in the checkpoint).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3train.kernels.precision import upcast


def _gate_argument(
    z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return `(exp(A_log)` as `[H, 1]`, `z + dt_bias` as `[B, T, H, K])`, both in fp32 (float64
    inputs stay float64, so tests can hold implementations together to 1e-12)."""
    heads, key_dim = z.shape[-2:]
    if A_log.shape != (heads,):
        raise ValueError(f"A_log must have shape [H] = [{heads}], got {tuple(A_log.shape)}")
    if dt_bias.shape != (heads * key_dim,):
        raise ValueError(
            f"dt_bias must have shape [H*K] = [{heads * key_dim}], got {tuple(dt_bias.shape)}"
        )
    head_rate = upcast(A_log).exp().unsqueeze(-1)  # broadcast over the K channels of each head
    shifted = upcast(z) + upcast(dt_bias).reshape(heads, key_dim)
    return head_rate, shifted


def kda_gate(
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


def kda_gate_unbounded(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's gate: `g = −exp(A_log) · softplus(z + dt_bias)` (≤ 0, no lower bound).

    Args and return as `kda_gate`.
    """
    head_rate, shifted = _gate_argument(z, A_log, dt_bias)
    return -head_rate * F.softplus(shifted)
