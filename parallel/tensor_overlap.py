"""A tensor-parallel region's entry fused with the column-parallel projections it feeds, and its
leave fused with the row-parallel projection before it, so the collectives overlap the GEMMs
(Megatron's async tensor-parallel linear, torch's `_fused_all_gather_matmul` and
`_fused_matmul_reduce_scatter` on CUDA, in plain PyTorch with asynchronous collectives).

`tp.enter(x)` followed by `linear_j(x)` for each projection j computes, in forward,

    x_full = all_gather(x) (sequence parallel) or x (tensor parallel),   y_j = x_full · W_jᵀ

and in backward `dx_full = Σ_j dy_j · W_j`, reduce-scattered (SP) or all-reduced (TP) to the
ranks, and `dW_j = dy_jᵀ · x_full`. Here:

- forward, under sequence parallelism, this rank's sequence shard is gathered in `chunks`
  pieces along the sequence: while piece i+1 is on the wire, the GEMMs of piece i run (each
  gathered piece holds that piece of every rank's shard, which are rows of every output);
- backward computes `dx_full` piece by piece and launches each piece's reduce-scatter (TP: one
  all-reduce) as soon as it is computed, then the weight gradients `dW_j` while the collectives
  are in flight, and waits last.

The leave, `tp.leave(x · Wᵀ)` of a row-parallel projection (each rank's partial product summed
over the ranks: reduce-scattered along the sequence under SP, all-reduced without), is the mirror:

- forward, the partial product is computed in `chunks` pieces (under SP piece i holds positions
  i of every rank's shard, so its reduce-scatter leaves each rank piece i of its own shard) and
  each piece's collective is launched as soon as its GEMM is done, under the next piece's GEMM;
- backward (SP), the output gradient's all-gather runs in the same pieces, one ahead, and each
  arrived piece's input-gradient GEMM runs while the next is on the wire; the weight gradient is
  one GEMM over the whole gathered gradient at the end (one rounding, as the unfused path's).
  Without SP the backward has no collective.

The same sums as the unfused path in another order (float64 tests hold them together). Only
plain `nn.Linear` projections without bias take this path (`TensorParallel.enter_projections`
falls back to `enter` + module calls for others, e.g. Transformer Engine's modules, which bring
their own overlap). Under autocast the GEMMs run in the autocast dtype in both passes, as
`F.linear` would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from k3train.parallel.comm import Group, TimedWork


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """`[start, end)` of `min(chunks, length)` near-equal pieces of `length` (earlier ones larger)."""
    pieces = max(1, min(chunks, length))
    base, extra = divmod(length, pieces)
    bounds, start = [], 0
    for index in range(pieces):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _wait(work: TimedWork | None) -> None:
    if work is not None:
        work.wait()


class _AutocastState:
    """The forward's autocast setting, re-entered in backward (a custom Function's backward runs
    outside the forward's autocast region)."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.enabled = torch.is_autocast_enabled(device_type)
        self.dtype = torch.get_autocast_dtype(device_type)

    def region(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


class _EnterProjections(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, sequence_parallel: bool, chunks: int, *weights: torch.Tensor):
        ctx.group, ctx.sequence_parallel, ctx.chunks = group, sequence_parallel, chunks
        ctx.autocast = _AutocastState(x.device.type)
        if not sequence_parallel:  # the input is already whole: no collective before the GEMMs
            ctx.save_for_backward(x, *weights)
            return (x.view_as(x), *(F.linear(x, weight) for weight in weights))
        batch, local, hidden = x.shape
        size = group.size
        x_full = x.new_empty(batch, size * local, hidden)
        ranks_view = x_full.view(batch, size, local, hidden)  # [b, rank, position in its shard, h]
        bounds = chunk_bounds(local, chunks)
        buffers = [x.new_empty(size * batch, end - start, hidden) for start, end in bounds]

        def launch(index: int) -> TimedWork | None:
            start, end = bounds[index]
            return group.all_gather_async(x[:, start:end], buffers[index])

        outputs: list[torch.Tensor] = []
        pending = launch(0)
        for index, (start, end) in enumerate(bounds):
            following = launch(index + 1) if index + 1 < len(bounds) else None
            _wait(pending)  # piece `index` of every shard has arrived; the next one is on the wire
            pending = following
            rows = ranks_view[:, :, start:end]
            rows.copy_(buffers[index].view(size, batch, end - start, hidden).transpose(0, 1))
            for which, weight in enumerate(weights):
                piece = F.linear(rows, weight)
                if index == 0:  # the outputs' dtype is the GEMM's (autocast's, when on)
                    outputs.append(piece.new_empty(batch, size * local, piece.shape[-1]))
                outputs[which].view(batch, size, local, -1)[:, :, start:end] = piece
        ctx.save_for_backward(x_full, *weights)
        return (x_full, *outputs)

    @staticmethod
    def backward(ctx, grad_input_full, *grad_outputs):
        saved = ctx.saved_tensors
        x_full, weights = saved[0], saved[1:]
        group, grads = ctx.group, list(grad_outputs)
        with ctx.autocast.region():
            if not ctx.sequence_parallel:
                grad_x = _input_gradient(grads, weights, grad_input_full, slice(None), x_full)
                work = group.all_reduce_async(grad_x)  # under the weight-gradient GEMMs below
                grad_weights = _weight_gradients(grads, weights, x_full)
                _wait(work)
                return (grad_x, None, None, None, *grad_weights)
            batch, full, hidden = x_full.shape
            size = group.size
            local = full // size
            works, pieces = [], []
            for start, end in chunk_bounds(local, ctx.chunks):
                rows = slice(start, end)
                piece = _input_gradient(grads, weights, grad_input_full, rows, x_full, size)  # [rank, b, c, h]
                pieces.append(piece.new_empty(batch, end - start, hidden))
                works.append(group.reduce_scatter_async(piece.view(size * batch, end - start, hidden), pieces[-1]))
            grad_weights = _weight_gradients(grads, weights, x_full)  # while the pieces are reduced
            for work in works:
                _wait(work)
        return (torch.cat(pieces, dim=1), None, None, None, *grad_weights)


def _input_gradient(
    grads: Sequence[torch.Tensor | None],
    weights: Sequence[torch.Tensor],
    grad_input_full: torch.Tensor | None,
    rows: slice,
    x_full: torch.Tensor,
    size: int = 0,
) -> torch.Tensor:
    """`Σ_j dy_j · W_j` (+ the gradient of the returned whole input) over the sequence positions
    `rows` of every rank's shard: `[rank, b, c, h]` contiguous when `size` (sequence parallel),
    else the whole `[b, s, h]`, in `x_full`'s dtype."""

    def per_rank(tensor: torch.Tensor) -> torch.Tensor:
        if not size:
            return tensor
        batch, full = tensor.shape[:2]
        return tensor.view(batch, size, full // size, -1)[:, :, rows]

    total: torch.Tensor | None = None
    for grad, weight in zip(grads, weights):
        if grad is not None:  # in the autocast dtype under autocast, as F.linear's backward
            term = torch.matmul(per_rank(grad), weight).to(x_full.dtype)
            total = term if total is None else total.add_(term)
    if grad_input_full is not None:
        extra = per_rank(grad_input_full).to(x_full.dtype)
        total = extra.clone() if total is None else total.add_(extra)
    if total is None:
        total = per_rank(x_full).new_zeros(per_rank(x_full).shape)
    return total.transpose(0, 1).contiguous() if size else total.contiguous()


def _weight_gradients(
    grads: Sequence[torch.Tensor | None], weights: Sequence[torch.Tensor], x_full: torch.Tensor
) -> list[torch.Tensor | None]:
    """`dW_j = dy_jᵀ · x_full` over every token, in each weight's dtype."""
    inputs = x_full.reshape(-1, x_full.shape[-1])
    out: list[torch.Tensor | None] = []
    for grad, weight in zip(grads, weights):
        if grad is None:
            out.append(None)
            continue
        flat = grad.reshape(-1, grad.shape[-1])
        out.append(torch.matmul(flat.t(), inputs).to(weight.dtype))
    return out


class _ProjectAndLeave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: Group, sequence_parallel: bool, chunks: int):
        ctx.group, ctx.sequence_parallel, ctx.chunks = group, sequence_parallel, chunks
        ctx.autocast = _AutocastState(x.device.type)
        ctx.save_for_backward(x, weight)
        batch, full = x.shape[:2]
        size = group.size
        works, pieces = [], []
        if not sequence_parallel:  # the sum stays on every rank: pieces along the whole sequence
            for start, end in chunk_bounds(full, chunks):
                piece = F.linear(x[:, start:end], weight).contiguous()
                works.append(group.all_reduce_async(piece))
                pieces.append(piece)
        else:
            local = full // size
            per_rank = x.view(batch, size, local, x.shape[-1])  # [b, rank, position in its shard, in]
            for start, end in chunk_bounds(local, chunks):
                partial = F.linear(per_rank[:, :, start:end], weight)  # [b, rank, c, out]
                send = partial.transpose(0, 1).contiguous()  # [rank, b, c, out]: rank r's rows first
                pieces.append(send.new_empty(batch, end - start, send.shape[-1]))
                works.append(group.reduce_scatter_async(send.view(size * batch, end - start, -1), pieces[-1]))
        for work in works:
            _wait(work)
        return torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        group = ctx.group
        with ctx.autocast.region():
            if not ctx.sequence_parallel:  # the gradient is already every rank's: no collective
                grad_x = torch.matmul(grad_output, weight).to(x.dtype)
                return grad_x, _weight_gradients([grad_output], [weight], x)[0], None, None, None
            batch, full, features = x.shape
            size = group.size
            local = full // size
            bounds = chunk_bounds(local, ctx.chunks)
            width = grad_output.shape[-1]
            buffers = [grad_output.new_empty(size * batch, end - start, width) for start, end in bounds]
            grad_full = grad_output.new_empty(batch, size, local, width)  # the gathered gradient
            grad_x = x.new_empty(batch, size, local, features)

            def launch(index: int) -> TimedWork | None:
                start, end = bounds[index]
                return group.all_gather_async(grad_output[:, start:end].contiguous(), buffers[index])

            pending = launch(0)
            for index, (start, end) in enumerate(bounds):
                following = launch(index + 1) if index + 1 < len(bounds) else None
                _wait(pending)
                pending = following
                rows = grad_full[:, :, start:end]
                rows.copy_(buffers[index].view(size, batch, end - start, width).transpose(0, 1))
                grad_x[:, :, start:end] = torch.matmul(rows, weight).to(x.dtype)
            grad_weight = _weight_gradients([grad_full.view(batch, full, width)], [weight], x)[0]
        return grad_x.view(batch, full, features), grad_weight, None, None, None


def project_and_leave(
    x: torch.Tensor, weight: torch.Tensor, group: Group, sequence_parallel: bool, chunks: int
) -> torch.Tensor:
    """`tp.leave(x · Wᵀ)` of a row-parallel projection with the leave's collectives overlapped
    (module docstring). `group.size > 1`."""
    return _ProjectAndLeave.apply(x, weight, group, sequence_parallel, chunks)


def enter_and_project(
    x: torch.Tensor, group: Group, sequence_parallel: bool, weights: Sequence[torch.Tensor], chunks: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the region's whole input, `[x_full · W_jᵀ for each weight]`) with the entry's collectives
    overlapped (module docstring). `group.size > 1`."""
    whole, *outputs = _EnterProjections.apply(x, group, sequence_parallel, chunks, *weights)
    return whole, outputs
