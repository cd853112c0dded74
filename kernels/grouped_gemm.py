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

The function's products run as torch's `_grouped_mm` where it takes the operands, on CPU too
(torch 2.13 runs it there forward and backward for fp32/bf16/fp16 operands whose strides are
multiples of 16 bytes, given a contiguous output gradient): one call instead of a Python loop of
small matmuls, as fast as dense matmuls of the same FLOPs (benchmarks/moe.py, table e). Other
operands (float64, odd widths) take the per-group loop. `_grouped_mm` gets a FLOP formula here,
so `FlopCounterMode` counts it like the matmuls it replaces.

On CPU in bf16/fp16 each GEMM goes through oneDNN, which builds (JIT-compiles) one kernel per
GEMM shape and caches it. A group's row count is the number of slots routed to its expert, new
almost every call, so an unpadded grouped GEMM pays a kernel build for most groups: 8-11 ms for
a `[4096, 256] × [16, 256, 256]` bf16 product with fresh group sizes against 4 ms for sizes it
has seen (docs/performance.md). `GroupPadding` pads every group with zero rows to one of a few
sizes (`bucket_rows`) so that the shapes repeat; fp32 runs MKL's GEMM, which builds nothing.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils import flop_counter


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


def _fits_torch_grouped_mm(*tensors: torch.Tensor) -> bool:
    """Whether torch's `_grouped_mm` takes these operands: fp32/bf16/fp16, and every stride but
    the unit one (and the data pointer) a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    for tensor in tensors:
        if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        size = tensor.element_size()
        if tensor.data_ptr() % 16 or any((stride * size) % 16 for stride in tensor.stride() if stride != 1):
            return False
    return True


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Multiply-adds ×2 of `_grouped_mm`: 2-D × 2-D (groups along the contraction, the weight
    gradient) is `2·M·K·N` summed over the groups; otherwise every output entry contracts the
    last dimension of `a`."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


if hasattr(torch.ops.aten, "_grouped_mm") and torch.ops.aten._grouped_mm not in flop_counter.flop_registry:
    flop_counter.register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flop)


class _GroupedMM(torch.autograd.Function):
    """Grouped matmul whose backward writes each gradient once, in full.

    Products run as torch's `_grouped_mm` where it takes the operands (on CPU too), else as one
    BLAS call per group writing into its rows of a preallocated output (`dW[g] = 0` for a group
    without rows)."""

    @staticmethod
    def forward(ctx, x, weights, group_ends):
        bounds = _group_bounds(group_ends)
        covered = bounds[-1][1] if bounds else 0
        rows = x[:covered]
        offsets = group_ends.to(torch.int32)
        if covered and _fits_torch_grouped_mm(rows, weights):
            output = torch._grouped_mm(rows, weights, offs=offsets)
        else:
            output = x.new_empty(covered, weights.shape[-1])  # every row belongs to a group
            for group, (start, end) in enumerate(bounds):
                if end > start:
                    torch.mm(rows[start:end], weights[group], out=output[start:end])
        ctx.bounds = bounds
        ctx.save_for_backward(x, weights, offsets)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, weights, offsets = ctx.saved_tensors
        bounds = ctx.bounds
        covered = bounds[-1][1] if bounds else 0
        rows = x[:covered]
        grad_output = grad_output.contiguous()  # `_grouped_mm` rejects expanded (stride-0) gradients
        # dW in the layout of `weights` (often a transposed view of [groups, out, in] parameters),
        # so it reaches the parameter without a layout copy: compute dWᵀ when that is contiguous.
        transposed = not weights.is_contiguous() and weights.transpose(-2, -1).is_contiguous()
        fused = covered > 0 and _fits_torch_grouped_mm(rows, weights, grad_output)
        grad_x = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_rows = torch._grouped_mm(grad_output, weights.transpose(-2, -1), offs=offsets) if fused else None
            if fused and covered == x.shape[0]:
                grad_x = grad_rows
            else:
                grad_x = x.new_empty(x.shape)
                grad_x[covered:].zero_()  # rows past the last group take no part
                if fused:
                    grad_x[:covered].copy_(grad_rows)
        if ctx.needs_input_grad[1] and fused:
            if transposed:
                grad_weights = torch._grouped_mm(grad_output.t(), rows, offs=offsets).transpose(-2, -1)
            else:
                grad_weights = torch._grouped_mm(rows.t(), grad_output, offs=offsets)
        elif ctx.needs_input_grad[1]:
            grad_weights = torch.zeros_like(weights)  # keeps the strides of `weights`
        if not fused:
            for group, (start, end) in enumerate(bounds):
                if end == start:
                    continue
                if grad_x is not None:
                    torch.mm(grad_output[start:end], weights[group].t(), out=grad_x[start:end])
                if grad_weights is not None:
                    torch.mm(rows[start:end].t(), grad_output[start:end], out=grad_weights[group])
        return grad_x, grad_weights, None


def bucket_rows(rows: int) -> int:
    """`rows` as they are below 64 (64 shapes, which repeat anyway), rounded up to a multiple of
    32 below 512, and to 1/16 of its power of two above: the shapes a GEMM sees repeat, at most
    31 padding rows below 512 and 6.25% above. (Measured on the 512-wide model against 8 sizes per octave from
    16 rows on, whose more shapes kept missing oneDNN's cache: docs/performance.md.)"""
    if rows <= 0:
        return 0
    step = bucket_step(rows)
    return -(-rows // step) * step


def bucket_step(rows: int) -> int:
    """The multiple `bucket_rows` rounds `rows` (> 0) up to."""
    return 1 if rows < 64 else max(32, 1 << max(0, rows.bit_length() - 5))


def expected_padding_rows(mean_rows: float) -> float:
    """`E[bucket_rows(c) − c]` for a group whose row count `c` is Poisson with mean `mean_rows`
    (slots spread at random over the groups): the planner's estimate of a group's padding."""
    if mean_rows <= 0:
        return 0.0
    spread = 8 * math.sqrt(mean_rows) + 16
    low, high = max(0, int(mean_rows - spread)), int(mean_rows + spread) + 1
    log_mean = math.log(mean_rows)
    return sum(
        math.exp(count * log_mean - mean_rows - math.lgamma(count + 1)) * (bucket_rows(count) - count)
        for count in range(low, high)
    )


def pads_groups(rows: torch.Tensor) -> bool:
    """Whether grouped GEMMs of `rows` run faster with `GroupPadding`: on CPU in bf16/fp16
    (oneDNN's per-shape kernels; module docstring)."""
    return rows.device.type == "cpu" and rows.dtype in (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GroupPadding:
    """Grouped rows laid out with every group padded by zero rows: `ends` the padded cumulative
    counts, `keep` the padded position of each original row (`[Σ counts]`, int64)."""

    ends: torch.Tensor
    keep: torch.Tensor
    rows: int  # padded rows in all

    @classmethod
    def of(cls, counts: Sequence[int], padded_counts: Sequence[int], device: torch.device) -> "GroupPadding":
        starts = [0]
        for padded in padded_counts[:-1]:
            starts.append(starts[-1] + padded)
        keep = (
            torch.cat([torch.arange(start, start + count, dtype=torch.int64) for count, start in zip(counts, starts)])
            if counts
            else torch.zeros(0, dtype=torch.int64)
        )
        ends = torch.tensor(padded_counts, dtype=torch.int64).cumsum(0)
        return cls(ends.to(device), keep.to(device), int(sum(padded_counts)))

    @classmethod
    def bucketed(cls, group_ends: torch.Tensor) -> "GroupPadding":
        """Every group padded to `bucket_rows` of its count (a host read of `group_ends`)."""
        ends = group_ends.tolist()
        counts = [end - start for start, end in zip([0] + ends[:-1], ends)]
        return cls.of(counts, [bucket_rows(count) for count in counts], group_ends.device)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` (the grouped rows first; any after the last group are dropped) in the padded
        layout, zeros between the groups; differentiable."""
        shape = (self.rows, *rows.shape[1:])
        return rows.new_zeros(shape).index_copy(0, self.keep, rows[: self.keep.shape[0]])

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """The original rows of a padded-layout result."""
        return padded.index_select(0, self.keep)


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm` on CUDA for bf16 inputs (the dtype its CUDA kernels are built for),
    the per-group function with in-place gradients otherwise."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, weights, offs=group_ends.to(torch.int32))
    return _GroupedMM.apply(x, weights, group_ends)
