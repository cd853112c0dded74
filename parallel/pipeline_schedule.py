"""The pipeline plan: layer partition, the AttnRes block protocol's accounting, 1F1B orders.

Pure Python (no process groups): every rank computes the same plan from the configuration alone.
Partition, block accounting per hop (naive, paper, exact delta), the schedules and the simulator
are described in docs/pipeline.md ("The plan").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from k3train.contracts import stage_io
from k3train.parallel.config import LayoutError, check_pipeline_sizes

Protocol = Literal["naive", "paper", "exact"]
PROTOCOLS: tuple[Protocol, ...] = ("naive", "paper", "exact")


class PipelineConfigError(LayoutError):
    """A pipeline layout that cannot run; the message says why and what would."""


# ---------------------------------------------------------------------------- partition
def partition_layers(
    num_layers: int, pp: int, virtual_stages: int = 1, pipeline_layers: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """`[start, end)` layer range of every chunk, in chunk order (chunk c on rank c mod pp)."""
    chunks = pp * virtual_stages
    if pipeline_layers is None:
        if num_layers < chunks:
            raise PipelineConfigError(
                f"model.num_hidden_layers={num_layers} cannot fill pp*virtual_stages = {pp}*{virtual_stages} = "
                f"{chunks} pipeline chunks (each chunk needs at least one layer); use fewer stages"
            )
        base, extra = divmod(num_layers, chunks)
        counts = [base + (1 if c < extra else 0) for c in range(chunks)]
    else:
        counts = list(pipeline_layers)
        if len(counts) != chunks:
            raise PipelineConfigError(
                f"parallel.pipeline_layers has {len(counts)} entries but pp*virtual_stages = {chunks}: "
                f"give one layer count per chunk, in chunk order (chunk c runs on rank c mod {pp})"
            )
        if sum(counts) != num_layers:
            raise PipelineConfigError(
                f"parallel.pipeline_layers {counts} sums to {sum(counts)}, but the model has "
                f"model.num_hidden_layers={num_layers}; give counts that sum to {num_layers}"
            )
        if min(counts) < 1:
            raise PipelineConfigError(
                f"parallel.pipeline_layers {counts} has an empty chunk; every chunk needs at least one layer"
            )
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def blocks_before_layer(attn_res: str, block_size: int, layer: int) -> int:
    """Block representations in the residual state at the input of decoder layer `layer`
    (`layer = L`: after the last one), by the model's own rule (`contracts.stage_io`)."""
    try:
        return stage_io.blocks_before_layer(attn_res, block_size, layer)
    except ValueError as error:
        raise PipelineConfigError(str(error)) from None


# ---------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PipelinePlan:
    """Who runs which layers, and which block representations every hop carries."""

    pp: int
    virtual_stages: int
    chunks: tuple[tuple[int, int], ...]  # layer range per chunk
    blocks_at: tuple[int, ...]  # blocks in the state at the input of chunk c; [C]: after the last layer

    @classmethod
    def build(
        cls,
        num_layers: int,
        pp: int,
        virtual_stages: int = 1,
        attn_res: str = "block",
        block_size: int = 1,
        pipeline_layers: Sequence[int] | None = None,
    ) -> PipelinePlan:
        check_pipeline_sizes(pp, virtual_stages)
        chunks = partition_layers(num_layers, pp, virtual_stages, pipeline_layers)
        boundaries = [start for start, _ in chunks] + [num_layers]
        return cls(
            pp,
            virtual_stages,
            tuple(chunks),
            tuple(blocks_before_layer(attn_res, block_size, layer) for layer in boundaries),
        )

    @classmethod
    def from_config(cls, model_config, parallel_config) -> PipelinePlan:
        """From `ModelConfig` (num_hidden_layers, attn_res, attn_res_block_size) and `ParallelConfig`
        (pp, virtual_stages, pipeline_layers)."""
        if parallel_config.pp > 1 and model_config.tie_word_embeddings:
            raise PipelineConfigError(
                "model.tie_word_embeddings=true with parallel.pp > 1 is not supported (the embedding and the "
                "head live on different stages); untie them or use pp=1"
            )
        return cls.build(
            model_config.num_hidden_layers,
            parallel_config.pp,
            parallel_config.virtual_stages,
            model_config.attn_res,
            model_config.attn_res_block_size,
            parallel_config.pipeline_layers,
        )

    # ------------------------------------------------------------------ chunks and ranks
    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp

    def virtual_stage_of(self, chunk: int) -> int:
        return chunk // self.pp

    def chunk_index(self, rank: int, virtual_stage: int) -> int:
        return virtual_stage * self.pp + rank

    def chunks_of_rank(self, rank: int) -> list[int]:
        """This rank's chunks in virtual-stage order."""
        return [self.chunk_index(rank, v) for v in range(self.virtual_stages)]

    def layer_ranges(self, rank: int) -> list[tuple[int, int]]:
        """The `[start, end)` layers of each of this rank's chunks (build one model slice each)."""
        return [self.chunks[c] for c in self.chunks_of_rank(rank)]

    # ------------------------------------------------------------------ blocks
    def produced_blocks(self, chunk: int) -> range:
        """Blocks chunk `chunk` pushes (the embedding is block 0, pushed by layer 0)."""
        return range(self.blocks_at[chunk], self.blocks_at[chunk + 1])

    def hop_blocks(self, chunk: int, protocol: Protocol = "exact") -> range:
        """Blocks carried by hop `chunk → chunk+1` under `protocol` (forward, and their gradients back)."""
        if not 0 <= chunk < self.num_chunks - 1:
            raise IndexError(f"no hop after chunk {chunk} of {self.num_chunks}")
        end = self.blocks_at[chunk + 1]
        previous = chunk + 1 - self.pp  # the receiver's previous chunk of this micro-batch
        if protocol == "naive" or previous < 0:
            return range(0, end)
        if protocol == "paper":
            return range(self.blocks_at[previous], end)
        if protocol == "exact":
            return range(self.blocks_at[previous + 1], end)
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")

    def received_blocks(self, chunk: int) -> range:
        """Blocks chunk `chunk` receives (exact protocol); empty for chunk 0."""
        return self.hop_blocks(chunk - 1) if chunk > 0 else range(0)

    def held_blocks(self, chunk: int, after: Literal["forward", "backward"]) -> int:
        """Blocks of one micro-batch in the cache of `rank_of(chunk)` after that step of `chunk`:
        the prefix up to the chunk's output (the last chunk's own blocks stay inside its graph),
        and after its backward, what its previous chunk on the rank left."""
        if after == "forward":
            return self.blocks_at[chunk + 1] if chunk < self.num_chunks - 1 else self.blocks_at[chunk]
        previous = chunk - self.pp
        return self.blocks_at[previous + 1] if previous >= 0 else 0

    # ------------------------------------------------------------------ traffic
    def hop_block_counts(self, protocol: Protocol = "exact") -> list[int]:
        return [len(self.hop_blocks(c, protocol)) for c in range(self.num_chunks - 1)]

    def blocks_per_micro_batch(self, protocol: Protocol = "exact") -> int:
        """Block tensors all forward hops of one micro-batch carry (partial sums not included)."""
        return sum(self.hop_block_counts(protocol))

    def tensors_per_micro_batch(self, protocol: Protocol = "exact") -> int:
        """Tensors one micro-batch's forward hops carry: a partial sum plus the blocks, per hop."""
        return (self.num_chunks - 1) + self.blocks_per_micro_batch(protocol)

    def step_bytes(
        self, tensor_bytes: int, micro_batches: int, protocol: Protocol = "exact", backward: bool = True
    ) -> int:
        """Bytes all hops carry in one step (forward, plus the same again for the gradients)."""
        return self.tensors_per_micro_batch(protocol) * tensor_bytes * micro_batches * (2 if backward else 1)

    def rank_step_bytes(self, rank: int, tensor_bytes: int, micro_batches: int) -> dict[str, int]:
        """Bytes this rank sends in one step under the exact protocol: forward (its chunks' outgoing
        hops) and backward (the hops into its chunks, in reverse)."""
        forward = sum(1 + len(self.hop_blocks(c)) for c in self.chunks_of_rank(rank) if c < self.num_chunks - 1)
        backward = sum(1 + len(self.hop_blocks(c - 1)) for c in self.chunks_of_rank(rank) if c > 0)
        return {"forward": forward * tensor_bytes * micro_batches, "backward": backward * tensor_bytes * micro_batches}

    @property
    def max_hop_tensors(self) -> int:
        return 1 + max([len(self.hop_blocks(c)) for c in range(self.num_chunks - 1)], default=0)

    def describe(self) -> str:
        lines = [
            f"pipeline plan: pp={self.pp} virtual_stages={self.virtual_stages} "
            f"({self.num_chunks} chunks, {self.blocks_at[-1]} blocks)"
        ]
        for c, (start, end) in enumerate(self.chunks):
            hop = f"→ carries blocks {list(self.hop_blocks(c))}" if c < self.num_chunks - 1 else "→ head"
            lines.append(
                f"  chunk {c} (rank {self.rank_of(c)}, v{self.virtual_stage_of(c)}): layers {start}–{end - 1}, "
                f"in {self.blocks_at[c]} blocks, pushes {list(self.produced_blocks(c))} {hop}"
            )
        counts = {p: self.blocks_per_micro_batch(p) for p in PROTOCOLS}
        lines.append(
            f"  blocks sent per micro-batch: naive {counts['naive']}, paper {counts['paper']}, exact {counts['exact']}"
        )
        return "\n".join(lines)


# ---------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class Step:
    """One unit of work on one rank: a forward or backward of one chunk for one micro-batch."""

    kind: Literal["forward", "backward"]
    virtual_stage: int
    micro_batch: int

    def __repr__(self) -> str:
        return f"{self.kind[0].upper()}{self.micro_batch}" + (f"v{self.virtual_stage}" if self.virtual_stage else "")


def one_f_one_b(pp: int, rank: int, micro_batches: int) -> list[Step]:
    """Megatron's non-interleaved 1F1B: `P - rank - 1` warmup forwards, then one forward / one
    backward alternately, then the remaining backwards."""
    warmup = min(pp - rank - 1, micro_batches)
    steady = micro_batches - warmup
    steps = [Step("forward", 0, m) for m in range(warmup)]
    for i in range(steady):
        steps += [Step("forward", 0, warmup + i), Step("backward", 0, i)]
    steps += [Step("backward", 0, m) for m in range(steady, micro_batches)]
    return steps


def check_interleaved_micro_batches(pp: int, micro_batches: int) -> None:
    """Raise PipelineConfigError unless the interleaved schedule's micro-batches per rank come in
    whole groups of `pp` (its forwards walk the virtual stages one group at a time)."""
    if micro_batches % pp:
        raise PipelineConfigError(
            f"the interleaved schedule needs the number of micro-batches ({micro_batches}) to be a multiple of "
            f"parallel.pp={pp}; use {max(pp, micro_batches // pp * pp)} or {(micro_batches // pp + 1) * pp} "
            f"micro-batches (train.global_batch_size / train.micro_batch_size per data-parallel rank), "
            f"or parallel.virtual_stages=1"
        )


def interleaved_one_f_one_b(pp: int, virtual_stages: int, rank: int, micro_batches: int) -> list[Step]:
    """Megatron's interleaved 1F1B (`forward_backward_pipelining_with_interleaving`).

    The k-th forward runs virtual stage `(k mod PV) // P` on micro-batch `(k // PV)·P + k mod P`
    (groups of P micro-batches go through every virtual stage in turn); backwards mirror it with
    the virtual stage reversed. Warmup: `2(P - rank - 1) + (V - 1)P` forwards (all of them when
    that covers the step), then 1F1B, then the remaining backwards.
    """
    check_interleaved_micro_batches(pp, micro_batches)
    group = pp * virtual_stages
    total = micro_batches * virtual_stages

    def step(k: int, kind: Literal["forward", "backward"]) -> Step:
        virtual = (k % group) // pp
        if kind == "backward":
            virtual = virtual_stages - 1 - virtual
        return Step(kind, virtual, (k // group) * pp + k % pp)

    warmup = min(2 * (pp - rank - 1) + (virtual_stages - 1) * pp, total)
    steady = total - warmup
    steps = [step(k, "forward") for k in range(warmup)]
    for i in range(steady):
        steps += [step(warmup + i, "forward"), step(i, "backward")]
    steps += [step(k, "backward") for k in range(steady, total)]
    return steps


def schedule_steps(
    pp: int, virtual_stages: int, rank: int, micro_batches: int, forward_only: bool = False
) -> list[Step]:
    """This rank's steps for one optimizer step (or, `forward_only`, one evaluation pass)."""
    if micro_batches < 1:
        raise PipelineConfigError(f"a pipeline step needs at least one micro-batch, got {micro_batches}")
    steps = (
        interleaved_one_f_one_b(pp, virtual_stages, rank, micro_batches)
        if virtual_stages > 1
        else one_f_one_b(pp, rank, micro_batches)
    )
    if forward_only:
        steps = [s for s in steps if s.kind == "forward"]
    return steps


# ---------------------------------------------------------------------------- simulation
@dataclass
class SimulationResult:
    makespan: float
    busy: list[float]  # per rank
    step_times: list[list[tuple[Step, float, float]]]  # per rank: (step, start, end)

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of the idle share of the makespan."""
        return sum(1 - b / self.makespan for b in self.busy) / len(self.busy)


def simulate(
    pp: int,
    virtual_stages: int,
    micro_batches: int,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
    comm_time: float = 0.0,
) -> SimulationResult:
    """Run every rank's step list against the data dependencies (a chunk's forward needs the
    previous chunk's, its backward the next chunk's backward); each chunk step takes `forward_time
    / V` or `backward_time / V`. Raises PipelineConfigError if the orders deadlock."""
    chunks = pp * virtual_stages
    lists = [schedule_steps(pp, virtual_stages, r, micro_batches) for r in range(pp)]
    position = [0] * pp
    clock = [0.0] * pp
    done: dict[tuple[str, int, int], float] = {}  # (kind, chunk, micro-batch) → finish time
    timeline: list[list[tuple[Step, float, float]]] = [[] for _ in range(pp)]
    busy = [0.0] * pp
    remaining = sum(len(steps) for steps in lists)
    while remaining:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(lists[rank]):
                step = lists[rank][position[rank]]
                chunk = step.virtual_stage * pp + rank
                if step.kind == "forward":
                    dependency = ("forward", chunk - 1, step.micro_batch) if chunk > 0 else None
                    duration = forward_time / virtual_stages
                else:
                    dependency = (
                        ("backward", chunk + 1, step.micro_batch)
                        if chunk < chunks - 1
                        else ("forward", chunk, step.micro_batch)
                    )
                    duration = backward_time / virtual_stages
                if dependency is not None and dependency not in done:
                    break
                ready = 0.0 if dependency is None else done[dependency] + (comm_time if dependency[1] != chunk else 0.0)
                start = max(clock[rank], ready)
                clock[rank] = start + duration
                busy[rank] += duration
                done[(step.kind, chunk, step.micro_batch)] = clock[rank]
                timeline[rank].append((step, start, clock[rank]))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = {r: lists[r][position[r]] for r in range(pp) if position[r] < len(lists[r])}
            raise PipelineConfigError(f"schedule deadlocks: ranks wait on {waiting}")
    return SimulationResult(max(clock), busy, timeline)


def bubble_formula(pp: int, virtual_stages: int, micro_batches: int) -> float:
    """Idle share of a step in the ideal schedule: `(P-1)/(V·M + P-1)` (V = 1: `(P-1)/(M+P-1)`)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)
