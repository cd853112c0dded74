"""Token-by-token reference for Kimi Delta Attention (the recurrent form of docs/design.md §1.1).

This is the ground truth the chunkwise kernel is tested against: one Python step per token,
written as close to the recurrence as possible. It is slow (O(T) small ops) and is not meant for
training.
"""

from __future__ import annotations

import torch


def compute_dtype_for(*tensors: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 if any input is float64, else float32 (also for bf16/fp16)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> None:
    """Raise ValueError unless the shapes follow the `[B, T, H, *]` convention of both kernels."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    batch, seq_len, heads, key_dim = q.shape
    expected = {
        "k": (k, (batch, seq_len, heads, key_dim)),
        "g": (g, (batch, seq_len, heads, key_dim)),
        "beta": (beta, (batch, seq_len, heads)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (batch, seq_len, heads):
        raise ValueError(f"v must be [B, T, H, V] = [{batch}, {seq_len}, {heads}, V], got {tuple(v.shape)}")
    if initial_state is not None:
        state_shape = (batch, heads, key_dim, v.shape[-1])
        if tuple(initial_state.shape) != state_shape:
            raise ValueError(
                f"initial_state must have shape [B, H, K, V] = {state_shape}, got {tuple(initial_state.shape)}"
            )


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the KDA recurrence one token at a time.

    Per head, with state `S` of shape `[K, V]` and per token:

        S = S * exp(g_t)[:, None]                 # channel-wise decay
        S = S + beta_t * k_t (v_t - k_tᵀ S)ᵀ        # delta-rule update
        o_t = (scale * q_t)ᵀ S

    Args:
        q, k: `[B, T, H, K]`, already L2-normalised by the caller.
        v: `[B, T, H, V]`.
        g: `[B, T, H, K]`, log-space decay (≤ 0).
        beta: `[B, T, H]`, write strength in (0, 1).
        scale: query scale, default `K ** -0.5`.
        initial_state: `[B, H, K, V]` state before the first token, or None for zeros.
        output_final_state: also return the state after the last token.

    Returns:
        `(o, final_state)`: `o` is `[B, T, H, V]` in `v.dtype`; `final_state` is `[B, H, K, V]` in
        the compute dtype (float32, or float64 for float64 inputs), or None.
    """
    check_kda_inputs(q, k, v, g, beta, initial_state)
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    if scale is None:
        scale = key_dim**-0.5
    dtype = compute_dtype_for(q, k, v, g, beta)
    output_dtype = v.dtype

    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q = q * scale
    if initial_state is None:
        state = q.new_zeros(batch, heads, key_dim, value_dim)
    else:
        state = initial_state.to(dtype)

    outputs = []
    for t in range(seq_len):
        q_t, k_t, v_t, g_t, beta_t = q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]
        state = state * g_t.exp().unsqueeze(-1)
        predicted_v = torch.einsum("bhk,bhkv->bhv", k_t, state)
        correction = beta_t.unsqueeze(-1) * (v_t - predicted_v)
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, correction)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t, state))

    if outputs:
        o = torch.stack(outputs, dim=1)
    else:
        o = v.new_zeros(batch, 0, heads, value_dim)
    return o.to(output_dtype), (state if output_final_state else None)
