"""What the layouts of one recipe share, computed once per search instead of once per layout.

Profiling `tools/plan.py --search` at K3 × 1,024 (cProfile) showed about 85% of its time
rebuilding the same things: a rank-0 `ParallelState` (every process group of the world,
O(world size) each) per pipeline rank of every layout, only to read its expert-parallel group;
and each stage's closed-form parameters and each chunk's activation formula again for every
micro-batch size, dispatch mode and recompute setting that shares them. The cached values are
the objects and floats the uncached calls return, so the search's numbers do not change.

One cache serves one model config (the search varies only `recompute`, which is part of the
activation key) and may be shared by the searches of several world sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from k3train.model.config import ModelConfig
from k3train.parallel.expert import ExpertParallel
from k3train.parallel.pipeline import theoretical_peak_blocks
from k3train.parallel.pipeline_schedule import PipelinePlan
from k3train.parallel.state import Layout, ParallelState
from k3train.planning.memory import ActivationShape, chunk_activation_bytes
from k3train.planning.stage_parameters import stage_parameters
from k3train.training.build import planning_parallel_state

ExpertKey = tuple[Layout, bool, str, float, int, str, str, int, int]
StageKey = tuple[tuple[tuple[int, int], ...], int, int]
ChunkKey = tuple[str, tuple[int, ...], ActivationShape, int]


@dataclass
class SearchCache:
    """Memoised rank-0 states, expert dispatchers, stage parameters, chunk activations and the
    pipeline cache's peak blocks."""

    states: dict[tuple[Layout, bool], ParallelState] = field(default_factory=dict)
    expert_parallels: dict[ExpertKey, ExpertParallel | None] = field(default_factory=dict)
    stages: dict[StageKey, tuple[float, float]] = field(default_factory=dict)
    chunks: dict[ChunkKey, float] = field(default_factory=dict)
    peak_blocks_of: dict[tuple[PipelinePlan, int, int], int] = field(default_factory=dict)

    def rank0_state(self, layout: Layout, sequence_parallel: bool) -> ParallelState:
        key = (layout, bool(sequence_parallel))
        if key not in self.states:
            self.states[key] = planning_parallel_state(layout, 0, sequence_parallel)
        return self.states[key]

    def expert_parallel(self, layout: Layout, parallel, num_experts: int) -> ExpertParallel | None:
        """`ExpertParallel.from_state` of rank 0 (None for ep = 1); raises its ValueError (the
        EP/SP rule) every time, as the uncached check does."""
        key = (
            layout,
            bool(parallel.sequence_parallel),
            parallel.expert_dispatch,
            parallel.capacity_factor,
            parallel.max_replicas_per_rank,
            getattr(parallel, "ep_transport", "auto"),
            getattr(parallel, "ep_replica_planning", "online"),
            getattr(parallel, "ep_top_up_replicas", 0),
            num_experts,
        )
        if key not in self.expert_parallels:
            state = self.rank0_state(layout, parallel.sequence_parallel)
            self.expert_parallels[key] = ExpertParallel.from_state(state, parallel, num_experts)
        return self.expert_parallels[key]

    def stage_parameters(
        self, cfg: ModelConfig, layer_ranges: Sequence[tuple[int, int]], tp: int, ep: int
    ) -> tuple[float, float]:
        key = (tuple(layer_ranges), tp, ep)
        if key not in self.stages:
            self.stages[key] = stage_parameters(cfg, layer_ranges, tp, ep)
        return self.stages[key]

    def chunk_activation_bytes(
        self, cfg: ModelConfig, layer_range: tuple[int, int], shape: ActivationShape, seq_length: int
    ) -> float:
        key = (cfg.recompute, tuple(layer_range), shape, seq_length)
        if key not in self.chunks:
            self.chunks[key] = chunk_activation_bytes(cfg, layer_range, shape, seq_length)
        return self.chunks[key]

    def peak_blocks(self, plan: PipelinePlan, rank: int, micro_batches: int) -> int:
        """`theoretical_peak_blocks`, which walks the schedule's step list."""
        key = (plan, rank, micro_batches)
        if key not in self.peak_blocks_of:
            self.peak_blocks_of[key] = theoretical_peak_blocks(plan, rank, micro_batches)
        return self.peak_blocks_of[key]


__all__ = ["SearchCache"]
