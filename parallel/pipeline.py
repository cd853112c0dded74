"""Pipeline parallelism: 1F1B and interleaved 1F1B over model chunks, with the AttnRes block cache.

A micro-batch crosses a stage boundary as `(partial_sum, new_block_representations)`; the
receiver keeps every block of a micro-batch in flight (`pipeline_cache.BlockCache`), so a hop
carries only the blocks it does not hold yet. The executor takes the chunks as given (built by
`k3train/training/build.py`); its contract with them, the way a step is run, overlap with data
parallelism and the message ordering rules are in docs/pipeline.md ("The executor").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field

import torch
from torch import nn

from k3train.contracts.stage_io import ResidualState
from k3train.contracts.token_batch import TokenBatch, token_rows
from k3train.parallel.comm import Group, TimedWork
from k3train.parallel.pipeline_cache import BlockCache, BlockCacheError
from k3train.parallel.pipeline_schedule import (  # noqa: F401  (re-exported)
    PROTOCOLS,
    PipelineConfigError,
    PipelinePlan,
    Step,
    blocks_before_layer,
    bubble_formula,
    interleaved_one_f_one_b,
    one_f_one_b,
    partition_layers,
    schedule_steps,
    simulate,
)

FORWARD, BACKWARD, DOCUMENTS = 0, 1, 2  # message directions (tags); DOCUMENTS: a forward hop's document starts


def residual_shape(
    micro_batch_size: int, seq_length: int, hidden_size: int, tp_size: int = 1, sequence_parallel: bool = False
) -> tuple[int, int, int]:
    """Shape of the partial sum and of every block on the wire (`[mb, seq / tp under SP, d]`)."""
    if sequence_parallel and tp_size > 1:
        if seq_length % tp_size:
            raise PipelineConfigError(
                f"data.seq_length={seq_length} does not split over tp={tp_size} (sequence parallelism)"
            )
        seq_length //= tp_size
    return (micro_batch_size, seq_length, hidden_size)


def theoretical_peak_blocks(plan: PipelinePlan, rank: int, micro_batches: int) -> int:
    """The most block tensors this rank must hold at once in a step: every block of every
    micro-batch in flight, once (`PipelinePlan.held_blocks` after each of the rank's steps)."""
    held: dict[int, int] = {}
    peak = 0
    for step in schedule_steps(plan.pp, plan.virtual_stages, rank, micro_batches):
        chunk = plan.chunk_index(rank, step.virtual_stage)
        held[step.micro_batch] = plan.held_blocks(chunk, step.kind)
        peak = max(peak, sum(held.values()))
    return peak


@dataclass
class PipelineStats:
    """What the last `run` did on this rank (times in seconds, from `time.perf_counter`)."""

    total_s: float = 0.0
    compute_s: float = 0.0  # forward/backward of the chunks, including posting sends
    wait_s: float = 0.0  # blocked on receives, and on outstanding sends at the end
    steps: int = 0
    peak_live_blocks: int = 0
    peak_block_grads: int = 0
    step_log: list[tuple[str, float, float]] = field(default_factory=list)  # (step, start, end) of compute

    @property
    def bubble_fraction(self) -> float:
        """Share of the step this rank spent not computing."""
        return 1.0 - self.compute_s / self.total_s if self.total_s > 0 else 0.0


@dataclass
class _ChunkRecord:
    """One chunk's forward for one micro-batch, kept until its backward."""

    partial_in: torch.Tensor | None  # received leaf (None on chunk 0)
    leaves: list[torch.Tensor]  # leaves of blocks 0 … blocks_at[c]-1 in this graph
    partial_out: torch.Tensor | None = None
    produced: dict[int, torch.Tensor] = field(default_factory=dict)  # block id → tensor in the graph
    loss: torch.Tensor | None = None


class PipelineExecutor:
    """Runs one step of micro-batches through this rank's model chunks (see the module docstring).

    Args:
        plan: the partition and block protocol (same on every rank).
        group: the pipeline group (`state.pp`); its size must be `plan.pp`.
        tensor_shape: shape of the partial sum and of each block (`residual_shape`).
        dtype: the dtype they travel in (and are received in).
        device: where receive buffers live (default: CPU, or the current CUDA device).
        forward_context: a context-manager factory around each chunk forward (e.g. autocast).
        grad_group: group for the backward messages (default `group`; see the module docstring).
        before_backward: `fn(virtual_stage, last)` called before every backward step; `last` is
            True for the last backward of that chunk in the step (turn on gradient reduction there).
        after_step: `fn(step, schedule)` called after every step (tests: cache accounting).
        trace_cache: record every cache change in `self.cache.trace`.
        document_starts_shape: `(micro_batch_size, seq_length)` when micro-batches carry document
            starts (`TokenBatch.document_starts`, the whole sequence): every chunk runs with them,
            and each forward hop carries them to the next stage with the activations.
    """

    def __init__(
        self,
        plan: PipelinePlan,
        group: Group,
        tensor_shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        forward_context: Callable[[], ContextManager] | None = None,
        grad_group: Group | None = None,
        before_backward: Callable[[int, bool], None] | None = None,
        after_step: Callable[[Step, PipelineExecutor], None] | None = None,
        trace_cache: bool = False,
        document_starts_shape: Sequence[int] | None = None,
    ):
        if group.size != plan.pp:
            raise PipelineConfigError(f"the pipeline group has {group.size} ranks but the plan has pp={plan.pp}")
        self.plan = plan
        self.group = group
        self.grad_group = grad_group or group
        self.rank = group.rank
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = device or (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.forward_context = forward_context or contextlib.nullcontext
        self.before_backward = before_backward
        self.after_step = after_step
        self.trace_cache = trace_cache
        self.document_starts_shape = None if document_starts_shape is None else tuple(document_starts_shape)
        self.cache = BlockCache(trace_cache)
        self.stats = PipelineStats()
        self._pending: list[tuple[TimedWork, torch.Tensor]] = []

    # ------------------------------------------------------------------ the step
    def run(
        self,
        model_chunks: Sequence[nn.Module],
        micro_batches: Sequence[torch.Tensor | TokenBatch | None],
        forward_only: bool = False,
        loss_scale: float | None = None,
    ) -> torch.Tensor:
        """One step over `micro_batches` (token tensors `[mb, seq+1]` or `TokenBatch`es, needed on
        the ranks holding the first or last chunk; later stages receive the document starts with
        the activations); returns the mean micro-batch loss on every rank of the group.
        Gradients of `loss_scale · Σ losses` (default `1/M`: the mean) accumulate into the chunks'
        parameters."""
        plan, rank = self.plan, self.rank
        if len(model_chunks) != plan.virtual_stages:
            raise PipelineConfigError(
                f"rank {rank} got {len(model_chunks)} model chunks; the plan gives it "
                f"{plan.virtual_stages} (one per virtual stage)"
            )
        self._chunks = list(model_chunks)
        self._micro_batches = micro_batches
        self._count = len(micro_batches)
        self._scale = 1.0 / self._count if loss_scale is None else loss_scale
        self._forward_only = forward_only
        steps = schedule_steps(plan.pp, plan.virtual_stages, rank, self._count, forward_only)
        last_backward = {}
        for index, step in enumerate(steps):
            if step.kind == "backward":
                last_backward[step.virtual_stage] = index
        self.cache = BlockCache(self.trace_cache)
        self.stats = PipelineStats()
        self._records: dict[tuple[int, int], _ChunkRecord] = {}
        self._losses: list[torch.Tensor] = []
        started = time.perf_counter()

        received = self._post_receives(steps[0])
        for index, step in enumerate(steps):
            upcoming = self._post_receives(steps[index + 1]) if index + 1 < len(steps) else None
            tensors = self._wait(received)
            begin = time.perf_counter()
            if step.kind == "forward":
                self._forward(step, tensors)
            else:
                if self.before_backward is not None:
                    self.before_backward(step.virtual_stage, last_backward[step.virtual_stage] == index)
                self._backward(step, tensors)
            end = time.perf_counter()
            self.stats.compute_s += end - begin
            self.stats.step_log.append((repr(step), begin - started, end - started))
            self._pending = [(work, t) for work, t in self._pending if not work.is_completed()]
            if self.after_step is not None:
                self.after_step(step, self)
            received = upcoming
        wait_start = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending = []
        self.stats.wait_s += time.perf_counter() - wait_start
        self.stats.total_s = time.perf_counter() - started
        self.stats.steps = len(steps)
        self.stats.peak_live_blocks = self.cache.peak
        self.stats.peak_block_grads = self.cache.peak_grads
        if self._records or self.cache.micro_batches():
            raise BlockCacheError(
                f"step ended with records {sorted(self._records)} and cached micro-batches {self.cache.micro_batches()}"
            )

        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if self._losses:
            loss = torch.stack([loss.double() for loss in self._losses]).sum() / self._count
        return self.group.broadcast(loss, source_index=plan.rank_of(plan.num_chunks - 1))

    # ------------------------------------------------------------------ forward
    def _forward(self, step: Step, received: list[torch.Tensor] | None) -> None:
        plan, cache, mb = self.plan, self.cache, step.micro_batch
        chunk_index = plan.chunk_index(self.rank, step.virtual_stage)
        chunk = self._chunks[step.virtual_stage]
        is_last = chunk_index == plan.num_chunks - 1
        grad = not self._forward_only
        record = _ChunkRecord(partial_in=None, leaves=[])
        starts = self._document_starts(mb, chunk_index, received)
        documents = {} if starts is None else {"document_starts": starts}
        with torch.set_grad_enabled(grad):
            with self.forward_context():
                if chunk_index == 0:
                    output = chunk(self._tokens(mb, chunk_index)[:, :-1], **documents)
                else:
                    assert received is not None, "a forward after chunk 0 receives its inputs"
                    record.partial_in = received[0].requires_grad_(grad)
                    for block, buffer in zip(plan.received_blocks(chunk_index), received[1:]):
                        cache.put(mb, block, buffer, "receive")
                    count = plan.blocks_at[chunk_index]
                    record.leaves = cache.leaves(mb, count) if grad else [cache.value(mb, j) for j in range(count)]
                    output = chunk(state=ResidualState(record.partial_in, list(record.leaves)), **documents)
            if is_last:
                loss_head = chunk.loss  # the last chunk's loss (K3ModelChunk.loss)
                assert callable(loss_head), "the last model chunk has a loss method"
                loss_mask = self._loss_mask(mb)
                labels = self._tokens(mb, chunk_index)[:, 1:]
                record.loss = loss_head(output, labels) if loss_mask is None else loss_head(output, labels, loss_mask)
                self._losses.append(record.loss.detach())
            else:
                self._check_output(output, chunk_index, record.leaves)
                record.partial_out = output.partial
                for block in plan.produced_blocks(chunk_index):
                    record.produced[block] = output.blocks[block]
                    cache.put(mb, block, output.blocks[block], "produce")
                hop = plan.hop_blocks(chunk_index)
                self._send(
                    [output.partial] + [cache.value(mb, j) for j in hop],
                    FORWARD,
                    chunk_index,
                    mb,
                    plan.rank_of(chunk_index + 1),
                )
                if starts is not None:
                    self._send([starts], DOCUMENTS, chunk_index, mb, plan.rank_of(chunk_index + 1))
        if grad:
            self._records[(step.virtual_stage, mb)] = record
        elif step.virtual_stage == plan.virtual_stages - 1:
            cache.drop(mb)  # the rank's last chunk of this micro-batch: nothing needs its blocks

    def _check_output(self, output, chunk_index: int, leaves: list[torch.Tensor]) -> None:
        expected = self.plan.blocks_at[chunk_index + 1]
        if not isinstance(output, ResidualState) or len(output.blocks) != expected:
            got = len(output.blocks) if isinstance(output, ResidualState) else type(output).__name__
            raise PipelineConfigError(
                f"chunk {chunk_index} (layers {self.plan.chunks[chunk_index]}) returned {got} blocks; the plan "
                f"expects {expected}: the plan's attn_res/block size disagree with the model's"
            )
        if any(output.blocks[j] is not leaf for j, leaf in enumerate(leaves)):
            raise PipelineConfigError(f"chunk {chunk_index} replaced a block it received (blocks are append-only)")

    def _document_starts(
        self, micro_batch: int, chunk_index: int, received: list[torch.Tensor] | None
    ) -> torch.Tensor | None:
        """The micro-batch's document starts: its own on the first chunk, else the ones that came
        with the activations (the last tensor received); None when micro-batches carry none."""
        if self.document_starts_shape is None:
            return None
        if chunk_index > 0:
            assert received is not None, "a forward after chunk 0 receives its inputs"
            return received.pop() > 0.5
        batch = self._micro_batches[micro_batch]
        starts = batch.document_starts if isinstance(batch, TokenBatch) else None
        if starts is None:
            raise PipelineConfigError(
                f"micro-batch {micro_batch} carries no document starts, but the executor was built to pass them on"
            )
        return starts.to(self.device, non_blocking=True)

    def _loss_mask(self, micro_batch: int) -> torch.Tensor | None:
        batch = self._micro_batches[micro_batch]
        mask = batch.loss_mask if isinstance(batch, TokenBatch) else None
        return None if mask is None else mask.to(self.device, non_blocking=True)

    def _tokens(self, micro_batch: int, chunk_index: int) -> torch.Tensor:
        batch = self._micro_batches[micro_batch]
        tokens = None if batch is None else token_rows(batch)
        if tokens is None:
            raise PipelineConfigError(
                f"chunk {chunk_index} needs the tokens of micro-batch {micro_batch} "
                f"(the first and last stages read inputs and labels)"
            )
        return tokens.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ backward
    def _backward(self, step: Step, received: list[torch.Tensor] | None) -> None:
        plan, cache, mb = self.plan, self.cache, step.micro_batch
        chunk_index = plan.chunk_index(self.rank, step.virtual_stage)
        record = self._records.pop((step.virtual_stage, mb))
        roots: list[torch.Tensor]
        grads: list[torch.Tensor | None]
        if chunk_index == plan.num_chunks - 1:
            assert record.loss is not None, "the last chunk's forward records its loss"
            roots, grads = [record.loss * self._scale], [None]
        else:
            assert record.partial_out is not None, "a chunk before the last records its output"
            assert received is not None, "a backward before the last chunk receives its gradients"
            roots = [record.partial_out]
            grads = [received[0].to(record.partial_out.dtype)]
            hop_grads = dict(zip(plan.hop_blocks(chunk_index), received[1:]))
            for block, tensor in record.produced.items():
                grad = hop_grads.pop(block)  # a block a chunk pushes always travels on its outgoing hop
                local = cache.pop_grad(mb, block)  # this rank's later chunks' use of it
                roots.append(tensor)
                grads.append((grad if local is None else grad + local).to(tensor.dtype))
            for block, grad in hop_grads.items():  # blocks this chunk passed on: they came in with it
                cache.accumulate(mb, block, grad)
        torch.autograd.backward(roots, grads)
        for block, leaf in enumerate(record.leaves):
            cache.accumulate(mb, block, leaf.grad)
        if chunk_index > 0:
            assert record.partial_in is not None, "a chunk after the first records its received input"
            incoming = plan.received_blocks(chunk_index)
            zeros = lambda: torch.zeros(self.tensor_shape, dtype=self.dtype, device=self.device)  # noqa: E731
            partial_grad = record.partial_in.grad if record.partial_in.grad is not None else zeros()
            block_grads = [cache.pop_grad(mb, j) for j in incoming]
            self._send(
                [partial_grad] + [g if g is not None else zeros() for g in block_grads],
                BACKWARD,
                chunk_index - 1,
                mb,
                plan.rank_of(chunk_index - 1),
            )
            cache.release(mb, incoming, "release")
        cache.release(mb, record.produced, "release")
        if step.virtual_stage == 0:
            cache.finish(mb)

    # ------------------------------------------------------------------ communication
    def _tag(self, direction: int, hop: int, micro_batch: int, index: int) -> int:
        return (
            (direction * self.plan.num_chunks + hop) * self._count + micro_batch
        ) * self.plan.max_hop_tensors + index

    def _send(self, tensors: list[torch.Tensor], direction: int, hop: int, micro_batch: int, destination: int) -> None:
        group = self.grad_group if direction == BACKWARD else self.group
        label = f"{self.group.name}.{'backward' if direction == BACKWARD else 'forward'}"
        for index, tensor in enumerate(tensors):
            tensor = tensor.detach().to(self.dtype).contiguous()
            work = group.isend(tensor, destination, tag=self._tag(direction, hop, micro_batch, index), label=label)
            self._pending.append((work, tensor))

    def _post_receives(self, step: Step) -> list[tuple[torch.Tensor, TimedWork]] | None:
        """Post the receives a step needs (its inputs: activations for a forward, gradients for a
        backward); None when it needs none."""
        plan = self.plan
        chunk_index = plan.chunk_index(self.rank, step.virtual_stage)
        if step.kind == "forward":
            if chunk_index == 0:
                return None
            direction, hop, source, group = FORWARD, chunk_index - 1, plan.rank_of(chunk_index - 1), self.group
        else:
            if chunk_index == plan.num_chunks - 1:
                return None
            direction, hop, source, group = BACKWARD, chunk_index, plan.rank_of(chunk_index + 1), self.grad_group
        posted = []
        for index in range(1 + len(plan.hop_blocks(hop))):
            buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
            posted.append((buffer, group.irecv(buffer, source, tag=self._tag(direction, hop, step.micro_batch, index))))
        if direction == FORWARD and self.document_starts_shape is not None:  # the starts come last
            buffer = torch.empty(self.document_starts_shape, dtype=self.dtype, device=self.device)
            posted.append((buffer, group.irecv(buffer, source, tag=self._tag(DOCUMENTS, hop, step.micro_batch, 0))))
        return posted

    def _wait(self, posted) -> list[torch.Tensor] | None:
        if posted is None:
            return None
        start = time.perf_counter()
        for _, work in posted:
            work.wait()
        self.stats.wait_s += time.perf_counter() - start
        return [buffer for buffer, _ in posted]
