"""Kimi Delta Attention from its raw inputs: the L2 normalisation of q and k, the decay gate and
β's sigmoid, then the chunkwise kernel.

`prepare_kda_inputs` is what a KDA layer computes between its short convolutions and the kernel
(each step its own autograd function: `kernels.norms.l2_normalize`, `gate.kda_gate` or
`gate.kda_gate_unbounded`, an fp32 sigmoid). `chunk_kda_from_raw` runs it and `chunk_kda`, or, on
CUDA with fla-core, hands everything to fla's kernel, which fuses those steps into its own
launches (`fla_backend.run_fla_chunk_kda_from_raw`). The two agree to fp32 rounding
(tests/unit/test_kda_fla_interpreter.py runs fla's kernels under Triton's interpreter against
the PyTorch path).
"""

from __future__ import annotations

import torch

from ..norms import l2_normalize
from ..precision import upcast
from . import fla_backend
from .chunk import chunk_kda
from .gate import kda_gate, kda_gate_unbounded


def prepare_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    gate_input: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(q̂, k̂, g, β)` as `chunk_kda` takes them: `q`, `k` `[B, T, H, K]` L2-normalised (FLA's
    `x / sqrt(Σx² + 1e-6)`, in their dtype), `g = gate(gate_input)` `[B, T, H, K]` in fp32
    (`lower_bound · sigmoid(exp(A_log)(z + dt_bias))`, or `−exp(A_log) softplus(z + dt_bias)`
    when `lower_bound` is None), `β = sigmoid(beta_logits)` `[B, T, H]` in fp32."""
    if lower_bound is not None:
        g = kda_gate(gate_input, A_log, dt_bias, lower_bound=lower_bound)
    else:
        g = kda_gate_unbounded(gate_input, A_log, dt_bias)
    return l2_normalize(q), l2_normalize(k), g, torch.sigmoid(upcast(beta_logits))


def chunk_kda_from_raw(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate_input: torch.Tensor,
    beta_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    backend: str = "auto",
    fla_safe_gate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_kda(*prepare_kda_inputs(...))`: q, k `[B, T, H, K]` before normalisation, v
    `[B, T, H, V]`, the gate's input `[B, T, H, K]`, β's logits `[B, T, H]`, `A_log` `[H]`,
    `dt_bias` `[H·K]`, the gate's `lower_bound` (None: the unbounded gate); the rest as
    `chunk_kda`. `backend`: "auto" runs fla's fused kernel where `chunk_kda` would run fla and
    the installed fla takes raw inputs (`fla_backend.fla_takes_raw_inputs`), else the steps above;
    "torch" always the steps above; "fla" always fla (an error where it cannot run).
    `fla_safe_gate`: fla's tensor-core path for bounded gates in [−5, 0) (off by default:
    `fla_backend`'s docstring)."""
    fused = fla_backend.use_fla_backend(backend, q, k, v, gate_input, initial_state) and (
        backend == "fla" or fla_backend.fla_takes_raw_inputs()
    )
    if fused:
        if scale is None:
            scale = q.shape[-1] ** -0.5
        return fla_backend.run_fla_chunk_kda_from_raw(
            q,
            k,
            v,
            gate_input,
            beta_logits,
            A_log,
            dt_bias,
            lower_bound,
            scale,
            initial_state,
            output_final_state,
            safe_gate=fla_safe_gate,
        )
    q, k, g, beta = prepare_kda_inputs(q, k, gate_input, beta_logits, A_log, dt_bias, lower_bound)
    return chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        backend=backend,
    )
