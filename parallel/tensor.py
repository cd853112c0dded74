"""Tensor and sequence parallelism: the communication around a tensor-parallel region, sharded
parameters, vocabulary-parallel embedding and cross-entropy.

A tensor-parallel region is a stretch of a sublayer whose weights are split over the `tp`
ranks: column-parallel projections (output features split, here always by whole heads or
channels) followed by a row-parallel one (input features split). Entering and leaving it is
the only communication:

| | enter (forward / backward) | leave (forward / backward) |
| --- | --- | --- |
| tensor parallel | identity / all-reduce | all-reduce / identity |
| + sequence parallel | all-gather sequence / reduce-scatter | reduce-scatter sequence / all-gather |

With sequence parallelism the activations between regions (norms, AttnRes, the routed experts)
are split along the sequence (dim 1 of `[batch, seq, hidden]`): each token's residual state and
block representations live on one TP rank only.

Parameters carry how they are split (Megatron marks them the same way):
- `param.tensor_parallel = True`, `param.partition_dim`: a shard of the full tensor;
- `param.tp_partial_grad = True`: replicated, but each TP rank's gradient covers only its own
  heads or tokens, so gradients are summed over `tp` (`reduce_tensor_parallel_grads`).
With a TP group of size 1 every function here is the identity and nothing is marked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from k3train.contracts.param_roles import HeadBlocks
from k3train.kernels.precision import upcast
from k3train.kernels.te import torch_linear
from k3train.parallel.comm import Group
from k3train.parallel.tensor_overlap import enter_and_project, project_and_leave

SEQUENCE_DIM = 1


class ShardedParameter(Protocol):
    """The marks of a sharded parameter (attributes torch does not declare, set on the tensor):
    it is the slice along `partition_dim` over `shard_group` of a tensor of shape `full_shape`.
    Set by `TensorParallel.mark_sharded` (a TP shard) and `ExpertParallel.mark_expert_params`
    (an expert-parallel stack); read and written through `cast(ShardedParameter, param)`."""

    full_shape: tuple[int, ...]
    partition_dim: int
    shard_group: Group


class TensorParallelShard(ShardedParameter, Protocol):
    """A TP shard's further marks (`TensorParallel.mark_sharded`): Muon gathers whole matrices
    over `tensor_parallel_group`; `head_blocks` counts this shard's heads only."""

    tensor_parallel: bool
    tensor_parallel_group: Group
    head_blocks: HeadBlocks


class PartialGradParameter(Protocol):
    """A replicated parameter whose gradient each TP rank sees only in part (`mark_partial_grad`)."""

    tp_partial_grad: bool


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad.contiguous().clone()), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        return group.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return group.all_gather(x, dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.reduce_scatter(grad, dim=SEQUENCE_DIM), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return group.reduce_scatter(x, dim=SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, dim=SEQUENCE_DIM), None


class _ScatterSequence(torch.autograd.Function):
    """Keep this rank's slice of a replicated tensor; backward gathers the slices."""

    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return x.chunk(group.size, dim=SEQUENCE_DIM)[group.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, dim=SEQUENCE_DIM), None


class TensorParallel:
    """The TP group, whether sequence parallelism is on, and the linear backend: what the
    model's layers need.

    `linear_factory(in_features, out_features, device=None, dtype=None)` builds every dense
    projection (`linear`, and the shards of `shard_linear`): `kernels.te.torch_linear` (the
    default, `nn.Linear(bias=False)`) or a `kernels.te.TELinearFactory` (Transformer Engine,
    with `tp_size=1` on this rank's shard: the regions here stay k3train's)."""

    def __init__(
        self,
        group: Group,
        sequence_parallel: bool,
        linear_factory: Callable | None = None,
        overlap_chunks: int = 0,
    ):
        self.group = group
        self.sequence_parallel = sequence_parallel and group.size > 1
        self.linear_factory = linear_factory or torch_linear
        self.overlap_chunks = overlap_chunks
        """`parallel.tp_overlap_chunks` (0, the default of a bare `TensorParallel`: no overlap in
        `enter_projections`; the model passes its parallel state's)."""

    @classmethod
    def single(cls, linear_factory: Callable | None = None) -> TensorParallel:
        """No tensor parallelism: every region boundary is the identity."""
        from k3train.parallel.comm import TrafficCounter

        return cls(Group("tp", (0,), 0, None, TrafficCounter()), sequence_parallel=False, linear_factory=linear_factory)

    def linear(self, in_features: int, out_features: int) -> nn.Module:
        """A dense projection `[out, in]` without bias, built by the linear backend."""
        return self.linear_factory(in_features, out_features)

    @property
    def grouped_gemm_factory(self) -> Callable | None:
        """`factory(groups, in, out)` of the routed experts' grouped GEMMs, None for the torch path."""
        return getattr(self.linear_factory, "grouped", None)

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Input of a TP region: the full sequence, replicated on every TP rank."""
        if self.size == 1:
            return x
        if self.sequence_parallel:
            return _GatherSequence.apply(x, self.group)
        return _CopyToRegion.apply(x, self.group)

    def enter_projections(
        self, x: torch.Tensor, projections: Sequence[nn.Module]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`enter(x)` and each column-parallel projection of it: (the region's whole input, the
        projections' outputs). Plain bias-free `nn.Linear` projections take the fused path whose
        collectives overlap the GEMMs (`parallel/tensor_overlap.py`); others, or
        `overlap_chunks == 0`, run `enter` and then the modules."""
        fused = (
            self.size > 1
            and self.overlap_chunks > 0
            and all(type(p) is nn.Linear and p.bias is None for p in projections)
        )
        if not fused:
            whole = self.enter(x)
            return whole, [projection(whole) for projection in projections]
        weights = [cast(nn.Linear, p).weight for p in projections]
        return enter_and_project(x, self.group, self.sequence_parallel, weights, self.overlap_chunks)

    def leave(self, partial_output: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs (row-parallel projection) back into the residual layout."""
        if self.size == 1:
            return partial_output
        if self.sequence_parallel:
            return _ReduceScatterSequence.apply(partial_output, self.group)
        return _ReduceFromRegion.apply(partial_output, self.group)

    def leave_projection(self, x: torch.Tensor, projection: nn.Module, fuse: bool = True) -> torch.Tensor:
        """`leave(projection(x))` of a row-parallel projection. A plain bias-free `nn.Linear` takes
        the fused path whose collectives overlap the GEMM's pieces (`parallel/tensor_overlap.py`)
        when `overlap_chunks > 0` and `fuse`; a caller whose forward is recomputed in backward
        passes `fuse=False` (a recomputed fused leave would run its collectives again, where the
        unfused leave's checkpoint stops at the projection's saved input)."""
        plain = type(projection) is nn.Linear and projection.bias is None
        if not (fuse and plain and self.size > 1 and self.overlap_chunks > 0):
            return self.leave(projection(x))
        weight = cast(nn.Linear, projection).weight
        return project_and_leave(x, weight, self.group, self.sequence_parallel, self.overlap_chunks)

    def scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated activation → this rank's sequence shard (identity without SP)."""
        if not self.sequence_parallel:
            return x
        return _ScatterSequence.apply(x, self.group)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's sequence shard → the full sequence (identity without SP)."""
        if not self.sequence_parallel:
            return x
        return _GatherSequence.apply(x, self.group)

    # ------------------------------------------------------------------ parameters
    def shard_linear(self, linear: nn.Module, partition_dim: int) -> nn.Module:
        """Replace `linear` (from `linear`) by its shard: `partition_dim` 0 = column-parallel,
        1 = row-parallel."""
        if self.size == 1:
            return linear
        weight, in_features, out_features = linear.weight, linear.in_features, linear.out_features
        assert isinstance(weight, torch.Tensor), "a projection's weight is a tensor"
        assert isinstance(in_features, int) and isinstance(out_features, int), "a projection's sizes are ints"
        full_shape = tuple(weight.shape)
        if full_shape[partition_dim] % self.size:
            raise ValueError(f"cannot split {full_shape} along {partition_dim} over {self.size} TP ranks")
        in_shard: int
        out_shard: int
        if partition_dim == 0:
            in_shard, out_shard = in_features, out_features // self.size
        else:
            in_shard, out_shard = in_features // self.size, out_features
        shard = self.linear_factory(in_shard, out_shard, device=weight.device, dtype=weight.dtype)
        for attribute, value in vars(weight).items():  # keep role markers (head blocks etc.)
            setattr(shard.weight, attribute, value)
        self.mark_sharded(shard.weight, partition_dim, full_shape)
        return shard

    def mark_sharded(self, param: torch.Tensor, partition_dim: int, full_shape: tuple[int, ...]) -> None:
        if self.size == 1:
            return
        marks = cast(TensorParallelShard, param)
        marks.tensor_parallel = True
        marks.partition_dim = partition_dim
        marks.full_shape = full_shape
        marks.tensor_parallel_group = self.group  # Muon gathers whole matrices through it
        marks.shard_group = self.group  # checkpoints store the full tensor, sharded over this group
        head_blocks = getattr(param, "head_blocks", None)
        if head_blocks is not None:  # whole heads per rank: the shard has fewer heads
            marks.head_blocks = HeadBlocks(head_blocks.dim, head_blocks.num_heads // self.size)

    def mark_partial_grad(self, params: Iterable[nn.Parameter]) -> None:
        if self.size == 1:
            return
        for param in params:
            cast(PartialGradParameter, param).tp_partial_grad = True


def reduce_tensor_parallel_grads(model: nn.Module, group: Group) -> None:
    """Sum over `tp` the gradients of replicated parameters that each rank saw only in part.

    For code without data parallelism (tests, tools). The training job does not call it: its
    `parallel.grad_reduce.GradientReducer` folds this sum into the data-parallel reduction (one SUM over
    the stage's dp×tp ranks), and calling both would sum twice."""
    if group.size == 1:
        return
    grads = [p.grad for p in model.parameters() if getattr(p, "tp_partial_grad", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([upcast(g.reshape(-1)) for g in grads])  # fp32 (float64 stays float64)
    group.all_reduce(flat)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


# ---------------------------------------------------------------------------- vocabulary parallel
class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over `tp`; each rank looks up its own range, the region's exit sums."""

    def __init__(self, vocab_size: int, hidden_size: int, tensor_parallel: TensorParallel):
        super().__init__()
        self.tp = tensor_parallel
        local_rows = vocab_size // tensor_parallel.size
        self.vocab_start = tensor_parallel.rank * local_rows
        self.vocab_end = self.vocab_start + local_rows
        self.weight = nn.Parameter(torch.empty(local_rows, hidden_size))
        tensor_parallel.mark_sharded(self.weight, 0, (vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids [batch, seq]` (full sequence) → embeddings in the residual layout."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        embeddings = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.leave(embeddings)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy per token over logits split along the vocabulary; three small all-reduces."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start: int, group: Group):
        logits = logits.float() if logits.dtype != torch.float64 else logits
        max_logit = logits.max(dim=-1).values
        group.all_reduce(max_logit, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - max_logit.unsqueeze(-1)
        local_labels = labels - vocab_start
        inside = (local_labels >= 0) & (local_labels < logits.shape[-1])
        target = shifted.gather(-1, local_labels.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        target = torch.where(inside, target, torch.zeros_like(target))
        group.all_reduce(target)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        group.all_reduce(sum_exp)
        ctx.save_for_backward(exp, sum_exp, local_labels, inside)
        return torch.log(sum_exp) - target

    @staticmethod
    def backward(ctx, grad_loss):
        exp, sum_exp, local_labels, inside = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)
        one_hot = torch.zeros_like(grad).scatter_(
            -1, local_labels.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), inside.unsqueeze(-1).to(grad.dtype)
        )
        return (grad - one_hot) * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group: Group
) -> torch.Tensor:
    """Per-token loss `[...]` from this rank's logits `[..., vocab/tp]` (vocabulary from `vocab_start`)."""
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_start, group)


# ---------------------------------------------------------------------------- checkpoints
class _MeshCache:
    """One DeviceMesh per (TP group, device type), built on first use (all TP ranks reach it together)."""

    def __init__(self) -> None:
        self.meshes: dict[tuple[int, str], Any] = {}

    def get(self, group: Group, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh

        key = (id(group), device_type)
        if key not in self.meshes:
            assert group.process_group is not None, f"{group.name}: sharded over one process"
            self.meshes[key] = DeviceMesh.from_group(group.process_group, device_type=device_type)
        return self.meshes[key]


def is_sharded(param: torch.Tensor) -> bool:
    """A slice of a larger tensor: a TP shard, or a rank's experts under expert parallelism."""
    return getattr(param, "shard_group", None) is not None


def as_global_dtensor(local: torch.Tensor, param: torch.Tensor, meshes: _MeshCache):
    """`local` (this rank's slice of something shaped like the sharded `param`: a TP shard or
    an expert-parallel stack) as a DTensor of the full tensor over `param.shard_group`, sharing
    `local`'s storage (loading into it writes `local` in place)."""
    from torch.distributed.tensor import DTensor, Shard

    marks = cast(ShardedParameter, param)
    full_shape = torch.Size(marks.full_shape)
    return DTensor.from_local(
        local,
        meshes.get(marks.shard_group, local.device.type),
        [Shard(marks.partition_dim)],
        run_check=False,
        shape=full_shape,
        stride=torch.empty(full_shape, device="meta").stride(),
    )


def local_from_saved(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a saved value: a DTensor, the full tensor, or already the shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    marks = cast(ShardedParameter, param)
    if tuple(value.shape) == tuple(marks.full_shape) != tuple(param.shape):
        group = marks.shard_group
        return value.chunk(group.size, dim=marks.partition_dim)[group.rank]
    return value


def install_sharded_state_dict(model: nn.Module) -> None:
    """Make `model.state_dict()` describe sharded parameters (TP shards, expert-parallel expert
    stacks) as DTensors of the full tensor.

    torch.distributed.checkpoint then stores every parameter once, by its global shape and each
    rank's slice, and loading under another TP size (or on one process) reads whichever slice
    the new layout needs. `load_state_dict` accepts DTensors, this rank's shard, or the full
    tensor (which it slices).
    """
    sharded = {name: param for name, param in model.named_parameters(remove_duplicate=False) if is_sharded(param)}
    if not sharded:
        return
    meshes = _MeshCache()

    def to_dtensors(module, state_dict, prefix, local_metadata):
        for name, param in sharded.items():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = as_global_dtensor(state_dict[key], param, meshes)

    def from_dtensors(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name, param in sharded.items():
            key = prefix + name
            if key in state_dict:
                state_dict[key] = local_from_saved(state_dict[key], param)

    model.register_state_dict_post_hook(to_dtensors)
    model.register_load_state_dict_pre_hook(from_dtensors)
