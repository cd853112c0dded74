"""Grouped matrix multiply for experts: rows of `x` sorted by group times each group's matrix.

`x [rows, in]` holds the rows of group 0, then group 1, ...; `weights [groups, in, out]`;
`group_ends [groups]` the cumulative row counts (int32). Returns `[rows, out]`.

On CUDA this is `torch._grouped_mm` (one kernel launch, offsets stay on the device). Elsewhere
a loop over groups (not over rows) is the reference; torch 2.13's CPU `_grouped_mm` runs
forward but its backward rejects these layouts, so training on CPU uses the loop.
"""

import torch


def grouped_mm_reference(x: torch.Tensor, weights: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """One matmul per group; reads the group boundaries on the host."""
    ends = group_ends.tolist()
    starts = [0] + ends[:-1]
    pieces = [x[start:end] @ weights[group] for group, (start, end) in enumerate(zip(starts, ends))]
    if not pieces:
        return x.new_zeros(x.shape[0], weights.shape[-1])
    return torch.cat(pieces, dim=0)


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm` on CUDA for bf16 inputs (the dtype its CUDA kernels are built for),
    the reference loop otherwise."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, weights, offs=group_ends.to(torch.int32))
    return grouped_mm_reference(x, weights, group_ends)
