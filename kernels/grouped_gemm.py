"""Grouped matrix multiply for experts: rows of `x` sorted by group times each group's matrix.

`x [rows, in]` holds the rows of group 0, then group 1, ...; `weights [groups, in, out]`;
`group_ends [groups]` the cumulative row counts (int32). Returns `[group_ends[-1], out]`.

On CUDA (bf16) this is `torch._grouped_mm` (one kernel launch, offsets stay on the device).
Elsewhere `grouped_mm` runs one matmul per group inside a custom autograd function: every
group's product is written straight into its rows of one output (forward) or one gradient
(backward), so backward allocates each gradient once. (Slicing under autograd instead gives every
group's slice its own full-size zero-filled gradient, summed afterwards: `groups` times the
memory traffic of `x` and of the weights.) `grouped_mm_reference` is the plain loop that the
tests compare against.

torch 2.13's CPU `_grouped_mm` runs forward and backward too (fp32/bf16 operands whose strides
are multiples of 16 bytes, and a contiguous output gradient), at about the speed of these
per-group calls (benchmarks/moe.py, table e); the per-group form is kept on CPU because it takes
any dtype and width (the float64 tests) and its matmuls are visible to `FlopCounterMode`.
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


def _group_bounds(group_ends: torch.Tensor) -> list[tuple[int, int]]:
    ends = group_ends.tolist()
    return list(zip([0] + ends[:-1], ends))


class _GroupedMM(torch.autograd.Function):
    """One BLAS call per group, each writing into its rows of a preallocated output; the backward
    writes each group's `dx` rows and `dW[g]` in place (`dW[g] = 0` for a group without rows)."""

    @staticmethod
    def forward(ctx, x, weights, group_ends):
        bounds = _group_bounds(group_ends)
        ctx.bounds = bounds
        ctx.save_for_backward(x, weights)
        if not bounds:
            return x.new_zeros(x.shape[0], weights.shape[-1])  # as the reference
        output = x.new_empty(bounds[-1][1], weights.shape[-1])  # every row up to the last end is in a group
        for group, (start, end) in enumerate(bounds):
            if end > start:
                torch.mm(x[start:end], weights[group], out=output[start:end])
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, weights = ctx.saved_tensors
        bounds = ctx.bounds
        if not bounds:
            return torch.zeros_like(x), torch.zeros_like(weights), None
        grad_x = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_x = x.new_empty(x.shape)
            grad_x[bounds[-1][1]:].zero_()  # rows past the last group take no part
        if ctx.needs_input_grad[1]:
            # Same strides as `weights` (the experts pass a transposed view of [groups, out, in]
            # parameters), so the gradient reaches the parameter without a layout copy.
            grad_weights = torch.empty_like(weights)
        for group, (start, end) in enumerate(bounds):
            if end == start:
                if grad_weights is not None:
                    grad_weights[group].zero_()
                continue
            if grad_x is not None:
                torch.mm(grad_output[start:end], weights[group].t(), out=grad_x[start:end])
            if grad_weights is not None:
                torch.mm(x[start:end].t(), grad_output[start:end], out=grad_weights[group])
        return grad_x, grad_weights, None


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm` on CUDA for bf16 inputs (the dtype its CUDA kernels are built for),
    the per-group function with in-place gradients otherwise."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, weights, offs=group_ends.to(torch.int32))
    return _GroupedMM.apply(x, weights, group_ends)
