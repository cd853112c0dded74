"""Per-Head Muon (Moonlight's Muon, orthogonalised per attention head and per expert) with AdamW
riding along for the parameters Muon must not touch, in one `torch.optim.Optimizer`.

The Muon work is a list of independent units (`MuonWorkItem`: one parameter and how it splits
into matrix blocks, `BlockLayout`) and the orthogonalisation is a pure function of the
momentum-updated gradient (`orthogonalized_update`). A distributed Muon (ZeRO-1: owner ranks
balanced by `MuonWorkItem.cost`, results all-gathered) reuses both without touching the maths.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, cast, overload

import torch
from torch.optim.adamw import adamw as adamw_functional

from k3train.contracts.param_roles import head_blocks_of
from k3train.optim.newton_schulz import (
    NS_COEFFICIENTS,
    NS_EPS,
    NS_STEPS,
    NsDtype,
    newton_schulz,
    ns_cost,
    ns_flops,
    resolve_ns_dtype,
)

if TYPE_CHECKING:
    from k3train.parallel.tensor import TensorParallelShard

BlockKind = Literal["matrix", "heads", "experts"]


@dataclass(frozen=True)
class BlockLayout:
    """How one Muon parameter splits into `num_blocks` independent `[rows, cols]` matrices.

    - "matrix": a 2-D weight orthogonalised whole (one block);
    - "heads": a 2-D attention projection cut into per-head blocks along `split_dim` (0: row
      blocks of q/k/v-like projections, 1: column blocks of o_proj);
    - "experts": a stack `[..., out, in]` of expert matrices, one block per leading index.
    """

    kind: BlockKind
    num_blocks: int
    rows: int
    cols: int
    split_dim: int | None = None
    """Parameter dimension cut into heads ("heads" only)."""

    def to_blocks(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (parameter-shaped) as a batch `[num_blocks, rows, cols]` (a view where possible)."""
        if self.kind == "heads" and self.split_dim == 1:
            # [out, H*hd] -> [out, H, hd] -> [H, out, hd]: each head's columns become one block.
            return t.reshape(self.rows, self.num_blocks, self.cols).transpose(0, 1)
        return t.reshape(self.num_blocks, self.rows, self.cols)

    def from_blocks(self, blocks: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """Inverse of `to_blocks`: the batch `[num_blocks, rows, cols]` back in `shape`."""
        if self.kind == "heads" and self.split_dim == 1:
            return blocks.transpose(0, 1).reshape(shape)
        return blocks.reshape(shape)

    def block(self, t: torch.Tensor, index: int) -> torch.Tensor:
        """Block `index` of the parameter-shaped `t`, as a `[rows, cols]` view."""
        return self.to_blocks(t)[index]

    def scale(self, update_rms: float) -> float:
        """Moonlight's RMS matching from the block's own shape: `update_rms*sqrt(max(rows, cols))`.

        An orthogonal `[A, B]` matrix has RMS `1/sqrt(max(A, B))`, so the scaled update has RMS
        about `update_rms` whatever the block shape, and Muon reuses AdamW's lr and weight decay.
        """
        return update_rms * math.sqrt(max(self.rows, self.cols))

    @property
    def cost(self) -> int:
        """Newton–Schulz cost of all blocks (`num_blocks * rows * cols * min(rows, cols)`)."""
        return self.num_blocks * ns_cost(self.rows, self.cols)

    def flops(self, steps: int = NS_STEPS) -> int:
        """Newton–Schulz FLOPs of all blocks (`num_blocks * ns_flops(rows, cols, steps)`)."""
        return self.num_blocks * ns_flops(self.rows, self.cols, steps)

    def describe(self) -> str:
        """Short form for start-up tables, e.g. `per-head 4×[32,128]`."""
        shape = f"[{self.rows},{self.cols}]"
        if self.kind == "matrix":
            return f"matrix {shape}"
        prefix = "per-head" if self.kind == "heads" else "experts"
        return f"{prefix} {self.num_blocks}×{shape}"


def block_layout(param: torch.Tensor, per_head: bool = True) -> BlockLayout:
    """The block layout Muon uses for `param`, read from its shape and `head_blocks` marker."""
    if param.ndim < 2:
        raise ValueError(f"Muon needs a matrix or a stack of matrices, got {tuple(param.shape)}")
    rows, cols = param.shape[-2], param.shape[-1]
    if param.ndim > 2:
        return BlockLayout("experts", math.prod(param.shape[:-2]), rows, cols)
    heads = head_blocks_of(param)
    if heads is None or not per_head:
        return BlockLayout("matrix", 1, rows, cols)
    if heads.dim not in (0, 1) or param.shape[heads.dim] % heads.num_heads:
        raise ValueError(f"head_blocks {heads} does not fit a parameter {tuple(param.shape)}")
    if heads.dim == 0:
        return BlockLayout("heads", heads.num_heads, rows // heads.num_heads, cols, split_dim=0)
    return BlockLayout("heads", heads.num_heads, rows, cols // heads.num_heads, split_dim=1)


def orthogonalized_update(
    momentum_input: torch.Tensor,
    layout: BlockLayout,
    *,
    update_rms: float = 0.2,
    ns_steps: int = NS_STEPS,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_eps: float = NS_EPS,
    ns_dtype: NsDtype = "auto",
    ns_cpu_bf16_min_flops: float | None = None,
) -> torch.Tensor:
    """Muon's update for one parameter from its (Nesterov) momentum: each block orthogonalised
    by one batched Newton–Schulz call and scaled by its own `layout.scale(update_rms)`.

    Pure: no state, no parameters touched. Returned in parameter shape, in NS's compute dtype
    (`resolve_ns_dtype`: on a CPU it depends on the blocks' sizes and the measured crossover).
    """
    blocks = layout.to_blocks(momentum_input)
    compute_dtype = resolve_ns_dtype(ns_dtype, blocks, ns_cpu_bf16_min_flops)
    blocks = newton_schulz(blocks, ns_steps, ns_coefficients, ns_eps, compute_dtype=compute_dtype)
    return layout.from_blocks(blocks * layout.scale(update_rms), momentum_input.shape)


def sharded_matrix_update(param: torch.Tensor, momentum_input: torch.Tensor, options: dict) -> torch.Tensor:
    """Muon's update of this rank's shard of a tensor-parallel matrix that is not split by heads
    (an MLP's gate/up/down projection): the shards are gathered over the TP group
    (`param.tensor_parallel_group`, set by `k3train.parallel.tensor`), the whole matrix is
    orthogonalised and scaled by its own shape, and each rank keeps its slice. Orthogonalising
    the shards separately would be a different optimizer."""
    shard = cast("TensorParallelShard", param)
    tp_group = shard.tensor_parallel_group
    full = tp_group.all_gather(momentum_input, dim=shard.partition_dim)
    update = orthogonalized_update(full, BlockLayout("matrix", 1, full.shape[0], full.shape[1]), **options)
    return update.chunk(tp_group.size, dim=shard.partition_dim)[tp_group.rank]


def sharded_matrix_layout(param: torch.Tensor) -> BlockLayout:
    """The whole-matrix layout `sharded_matrix_update` orthogonalises for a TP shard `param`."""
    shard = cast("TensorParallelShard", param)
    shape = list(param.shape)
    shape[shard.partition_dim] *= shard.tensor_parallel_group.size
    return BlockLayout("matrix", 1, shape[0], shape[1])


@dataclass(frozen=True)
class MuonStepStats:
    """What the last `PerHeadMuon.step` spent on Newton–Schulz on this rank (for the step line)."""

    ns_seconds: float = 0.0
    """Wall time of this rank's orthogonalisations (synchronised on CUDA)."""
    ns_flops: int = 0
    """Newton–Schulz FLOPs this rank executed (`ns_flops`; optimizer FLOPs, not model FLOPs)."""
    exchange_seconds: float = 0.0
    """Wall time of sharing the orthogonalised updates across data-parallel ranks (split only)."""


class OrthogonalizationSplit(Protocol):
    """Splits the orthogonalisation across data-parallel ranks (`k3train.parallel.muon_split`):
    every rank advances every momentum, but only a parameter's owner orthogonalises it; `share`
    then hands every rank every update."""

    def computes(self, param: torch.Tensor) -> bool:
        """Whether this rank orthogonalises `param`."""

    def share(self, params: Sequence[torch.Tensor], updates: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """`updates[i]` for `params[i]`: this rank's own filled in, the others' received."""


@dataclass(frozen=True)
class MuonWorkItem:
    """One independent unit of Muon work: a parameter, its blocks and its param-group index.

    A distributed Muon assigns work items to owner ranks (balancing `cost`); since blocks are
    independent, an item may also be cut further along its block batch.
    """

    param: torch.Tensor = field(compare=False)
    layout: BlockLayout
    group_index: int

    @property
    def cost(self) -> int:
        """Relative Newton–Schulz cost (see `newton_schulz.ns_cost`)."""
        return self.layout.cost


def fused_adamw_supported(params) -> bool:
    """Whether torch's fused AdamW kernel takes every parameter: floating point, on CPU or CUDA."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


class PerHeadMuon(torch.optim.Optimizer):
    """Moonlight Muon with per-head / per-expert blocks; groups with `algorithm="adamw"` get AdamW.

    Muon, for each block of a parameter (docs/design.md §1.6; Moonlight, arXiv 2502.16982, Eq. 1-4):
        M = momentum * M + G                  (sum-style buffer, state "momentum_buffer")
        U = G + momentum * M  if nesterov else M
        O = NS(U) * update_rms * sqrt(max(rows, cols))   (block shape, per block)
        W -= lr * weight_decay * W;   W -= lr * O
    AdamW groups use `torch.optim.adamw`'s functional update (same state keys as
    `torch.optim.AdamW`), so one optimizer object holds every parameter's state and the lr a
    scheduler writes into `param_groups` reaches both kinds.

    Group options (defaults from the constructor): `algorithm` ("muon" | "adamw"), `lr`,
    `weight_decay`; Muon: `momentum`, `nesterov`, `ns_steps`, `ns_coefficients`, `ns_eps`,
    `update_rms`, `per_head`, `ns_dtype` ("auto" | "float32" | "bfloat16"); AdamW: `betas`, `adam_eps`, `foreach`, `fused`
    (torch's fused AdamW kernel where it takes the group's parameters: CPU and CUDA floats).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_eps: float = NS_EPS,
        update_rms: float = 0.2,
        per_head: bool = True,
        betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        algorithm: Literal["muon", "adamw"] = "muon",
        foreach: bool | None = None,
        fused: bool = False,
        ns_dtype: NsDtype = "auto",
    ) -> None:
        if lr < 0 or weight_decay < 0 or momentum < 0:
            raise ValueError(f"need lr, weight_decay, momentum >= 0: {lr}, {weight_decay}, {momentum}")
        defaults = dict(
            algorithm=algorithm,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=tuple(ns_coefficients),
            ns_eps=ns_eps,
            update_rms=update_rms,
            per_head=per_head,
            betas=tuple(betas),
            adam_eps=adam_eps,
            foreach=foreach,
            fused=fused,
            ns_dtype=ns_dtype,
        )
        super().__init__(params, defaults)
        self.split: OrthogonalizationSplit | None = None
        # Not a group option: a checkpoint's groups override the optimizer's own on load, and the
        # crossover belongs to the machine that resumes, not the one that saved.
        self.ns_cpu_bf16_min_flops: float | None = None
        """Where "auto" Newton–Schulz switches to bf16 on a CPU (`bf16_probe`); None: this
        process's own probe. The job sets one value agreed by every rank."""
        """Set by `k3train.parallel.muon_split` under data parallelism without ZeRO-1."""
        self.step_stats = MuonStepStats()
        for group in self.param_groups:
            if group["algorithm"] not in ("muon", "adamw"):
                raise ValueError(f"unknown algorithm {group['algorithm']!r} (muon or adamw)")
            if group["algorithm"] == "muon":
                for p in group["params"]:
                    block_layout(p, group["per_head"])  # fail at construction, not at step 1

    def work_items(self) -> list[MuonWorkItem]:
        """Every Muon parameter as a work item, in param-group order (grads or not)."""
        return [
            MuonWorkItem(p, block_layout(p, group["per_head"]), index)
            for index, group in enumerate(self.param_groups)
            if group["algorithm"] == "muon"
            for p in group["params"]
        ]

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step over every group (Muon blocks, then AdamW groups)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pending = []
        for item in self.work_items():
            if item.param.grad is None:
                continue
            group = self.param_groups[item.group_index]
            pending.append((item, group))
        self._muon_updates(pending)
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_step(group)
        return loss

    def _muon_updates(self, pending: list[tuple[MuonWorkItem, dict]]) -> None:
        """Advance every momentum, orthogonalise (this rank's share of) the items and apply every
        update. With no split each update is applied as soon as it is made (one alive at a time);
        with a split, the owners' updates are shared first (the momenta stay replicated, so a
        checkpoint holds them all as without the split)."""
        cuda = any(item.param.is_cuda for item, _ in pending)
        if cuda:
            torch.cuda.synchronize()
        started, flops = time.perf_counter(), 0
        updates: list[torch.Tensor | None] = []
        for item, group in pending:
            momentum_input = self._momentum_input(item.param, group)
            if self.split is not None and not self.split.computes(item.param):
                updates.append(None)
                continue
            # A group restored from a checkpoint written before `ns_dtype` existed lacks the key.
            options = dict(
                update_rms=group["update_rms"],
                ns_steps=group["ns_steps"],
                ns_coefficients=group["ns_coefficients"],
                ns_eps=group["ns_eps"],
                ns_dtype=group.get("ns_dtype", "auto"),
                ns_cpu_bf16_min_flops=self.ns_cpu_bf16_min_flops,
            )
            if item.layout.kind == "matrix" and getattr(item.param, "tensor_parallel", False):
                update = sharded_matrix_update(item.param, momentum_input, options)
                flops += sharded_matrix_layout(item.param).flops(group["ns_steps"])
            else:
                update = orthogonalized_update(momentum_input, item.layout, **options)
                flops += item.layout.flops(group["ns_steps"])
            if self.split is None:
                self._apply_update(item.param, update, group)
            else:
                updates.append(update)
        if cuda:
            torch.cuda.synchronize()
        ns_seconds = time.perf_counter() - started
        exchange_seconds = 0.0
        if self.split is not None:
            shared = self.split.share([item.param for item, _ in pending], updates)
            exchange_seconds = time.perf_counter() - started - ns_seconds
            for (item, group), update in zip(pending, shared):
                self._apply_update(item.param, update, group)
        self.step_stats = MuonStepStats(ns_seconds, flops, exchange_seconds)

    def _momentum_input(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        """Advance the momentum buffer with `param.grad`; return what NS orthogonalises."""
        grad = param.grad
        assert grad is not None, "only parameters with a gradient step"
        if grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        momentum = group["momentum"]
        # Moonlight's sum-style buffer; torch.optim.Muon's EMA buffer is (1 - momentum) times
        # this and gives the same direction after NS's normalisation.
        buf.mul_(momentum).add_(grad)
        return grad.add(buf, alpha=momentum) if group["nesterov"] else buf

    @staticmethod
    def _apply_update(param: torch.Tensor, update: torch.Tensor, group: dict) -> None:
        """Decoupled weight decay with the unscaled lr, then the (already scaled) update."""
        lr = group["lr"]
        if group["weight_decay"]:
            param.mul_(1.0 - lr * group["weight_decay"])
        param.add_(update.to(param.dtype), alpha=-lr)

    def _adamw_step(self, group: dict) -> None:
        """AdamW on one group through torch's functional kernel: fused where asked and the kernel
        takes the parameters, else the for-loop kernel (foreach on CUDA)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            params.append(p)
        # A group restored from a checkpoint written before `fused` existed lacks the key.
        fused = bool(group.get("fused", False)) and fused_adamw_supported(params)
        for p in params:
            state = self.state[p]
            if not state:
                # The same state as torch.optim.AdamW (a float32 step tensor: on the CPU, or on the
                # parameter's device for the fused kernel), so checkpoints and tools that know
                # AdamW's layout read these groups unchanged.
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device if fused else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if fused and state["step"].device != p.device:  # a for-loop run's checkpoint
                state["step"] = state["step"].to(p.device)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw_functional(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=None if fused else group["foreach"],
            fused=fused or None,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["adam_eps"],
            maximize=False,
        )
