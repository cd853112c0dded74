"""Kimi Delta Attention kernels (docs/design.md §1.1): a token-by-token reference, the chunkwise-parallel
PyTorch form used for training (dispatching to flash-linear-attention on CUDA when available),
and the decay gates."""

from .chunk import chunk_kda
from .gate import kda_gate, kda_gate_reference, kda_gate_unbounded, kda_gate_unbounded_reference
from .naive import naive_recurrent_kda

__all__ = [
    "chunk_kda",
    "kda_gate",
    "kda_gate_reference",
    "kda_gate_unbounded",
    "kda_gate_unbounded_reference",
    "naive_recurrent_kda",
]
