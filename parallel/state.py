"""Process groups for data, context, tensor, pipeline and expert parallelism, from the launcher's environment.

Rank order (TP fastest, then CP, then DP, then PP), as in Megatron:

    global_rank = tp_rank + tp * (cp_rank + cp * (data_rank + data * pp_rank))

so the ranks of a tensor-parallel group are neighbours (one node's fast links), and the ranks
of a context-parallel group come next (they exchange KDA states, conv tails and MLA's latent KV
every layer, more often than DP's once-per-step gradients). The cp ranks of one data rank hold
the same weights and see different tokens of the same rows, so for everything that concerns
weights they are data-parallel replicas: `Layout.dp` counts the replicas of a stage, data × cp
(`Layout.data_parallel` is the number of distinct batch shards), and the replica index
`dp_rank = cp_rank + cp * data_rank` is what the `dp` group (gradient averaging, ZeRO-1), the
`data_tensor` and `model` groups and expert parallelism see. Expert parallelism is carved out of
the `dp × tp` ranks of one pipeline stage: number them `j = tp_rank + tp * dp_rank`; an
expert-parallel group is `ep` consecutive `j`, and the expert-data-parallel group (which reduces
expert gradients) joins the ranks with the same position in their expert-parallel groups.

Groups of size 1 carry no process group and make every collective the identity, so the
single-process model runs the same code with `ParallelState.single()`.

Every process group, the default one and each sub-group, is created with the same timeout
(`parallel.collective_timeout_s`): a rank that dies or stops answering makes its peers' next
collective fail within that bound instead of blocking forever; the job turns the failure into
one line naming the group (`comm.describe_collective_failure`).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from k3train.parallel.comm import EmulatedLink, Group, TrafficCounter
from k3train.parallel.config import (
    LayoutError,
    ModelSplitSizes,
    ParallelConfig,
    check_model_split,
    collective_timeout_seconds,
    divisors,
)
from k3train.parallel.pipeline_schedule import partition_layers


@dataclass(frozen=True)
class Layout:
    """Resolved sizes of a job."""

    world_size: int
    tp: int
    pp: int
    dp: int
    ep: int
    virtual_stages: int = 1
    cp: int = 1
    """Context-parallel size; `dp` above counts replicas of the weights, data × cp."""

    @property
    def data_parallel(self) -> int:
        """Distinct batch shards: the replicas over the context-parallel size."""
        return self.dp // self.cp

    def cp_groups(self) -> list[list[int]]:
        """Consecutive replica indices `dp_rank = cp_rank + cp * data_rank` of one (tp, pp) position."""
        return [
            [self.rank_of(t, d * self.cp + c, p) for c in range(self.cp)]
            for p in range(self.pp)
            for d in range(self.data_parallel)
            for t in range(self.tp)
        ]

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        return rank % self.tp, rank // self.tp % self.dp, rank // (self.tp * self.dp)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    # Each method returns every group of its kind, as lists of global ranks.
    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def data_tensor_groups(self) -> list[list[int]]:
        """All `dp × tp` ranks of one stage: they route distinct tokens under sequence parallelism."""
        block = self.tp * self.dp
        return [list(range(p * block, (p + 1) * block)) for p in range(self.pp)]

    def model_groups(self) -> list[list[int]]:
        """All `tp × pp` ranks that hold one model replica (for the global gradient norm)."""
        return [[self.rank_of(t, d, p) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)]

    def ep_groups(self) -> list[list[int]]:
        block = self.tp * self.dp
        return [
            [p * block + start + i for i in range(self.ep)]
            for p in range(self.pp)
            for start in range(0, block, self.ep)
        ]

    def expert_dp_groups(self) -> list[list[int]]:
        block = self.tp * self.dp
        return [
            [p * block + offset + start for start in range(0, block, self.ep)]
            for p in range(self.pp)
            for offset in range(self.ep)
        ]


def resolve_layout(
    world_size: int,
    tp: int,
    pp: int,
    dp: int,
    ep: int,
    virtual_stages: int,
    model: ModelSplitSizes,
    cp: int = 1,
) -> Layout:
    """Check a layout against the world size and the model; raise LayoutError with a fix."""
    if world_size < 1:
        raise LayoutError(f"world size must be at least 1 process, got {world_size}")
    if cp > 1:
        if world_size % (tp * pp * cp):
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}; "
                f"launch a multiple of {tp * pp * cp} processes or change parallel.cp"
            )
        data = world_size // (tp * pp * cp)
        if dp not in (0, data):
            raise LayoutError(
                f"parallel.dp={dp} but world size {world_size} / (tp*pp*cp = {tp * pp * cp}) leaves "
                f"dp={data}; set parallel.dp=0 (automatic) or {data}, or launch {dp * tp * pp * cp} "
                f"processes"
            )
        replicas = resolve_layout(world_size, tp, pp, data * cp, ep, virtual_stages, model)
        return Layout(world_size, tp, pp, replicas.dp, ep, virtual_stages, cp)
    if world_size % (tp * pp):
        fits = [f"tp={t} pp={p}" for t in divisors(world_size) for p in divisors(world_size // t)][:6]
        raise LayoutError(
            f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
            f"with {world_size} processes these fit: {', '.join(fits)}"
        )
    resolved_dp = world_size // (tp * pp)
    if dp not in (0, resolved_dp):
        raise LayoutError(
            f"parallel.dp={dp} but world size {world_size} / (tp*pp = {tp * pp}) leaves dp={resolved_dp}; "
            f"set parallel.dp=0 (automatic) or {resolved_dp}, or launch {dp * tp * pp} processes"
        )
    check_model_split(tp, ep, model)
    if (tp * resolved_dp) % ep:
        raise LayoutError(
            f"parallel.ep={ep} must divide dp*tp = {resolved_dp}*{tp} = {resolved_dp * tp} (expert parallelism is "
            f"carved out of the data- and tensor-parallel ranks); choose ep from {divisors(resolved_dp * tp)}"
        )
    partition_layers(model.num_layers, pp, virtual_stages)  # every chunk gets a layer (raises a LayoutError)
    return Layout(world_size, tp, pp, resolved_dp, ep, virtual_stages)


def layout_of(world_size: int, parallel_config, model_config) -> Layout:
    """The layout a recipe's `parallel` and `model` sections give on `world_size` processes
    (`resolve_layout` with every size taken from them)."""
    p = parallel_config
    return resolve_layout(world_size, p.tp, p.pp, p.dp, p.ep, p.virtual_stages, ModelSplitSizes.of(model_config), p.cp)


def emulated_links(emulate_network: Mapping[str, list[float]]) -> dict[str, EmulatedLink]:
    """`parallel.emulate_network` ({group: [GB/s, latency µs]}, checked by the config) as links."""
    return {name: EmulatedLink(gbps * 1e9, latency_us * 1e-6) for name, (gbps, latency_us) in emulate_network.items()}


class ParallelState:
    """This rank's place in the layout and its groups (`tp`, `dp`, `pp` and `pp_grad`, `ep`,
    `expert_dp`, `data_tensor`, `model`, `cp`), each a counted `Group`. `collective_timeout_s` bounds
    every collective of every sub-group (None: torch's default)."""

    def __init__(
        self,
        layout: Layout,
        rank: int,
        sequence_parallel: bool = False,
        counter: TrafficCounter | None = None,
        collective_timeout_s: float | None = None,
        network: Mapping[str, EmulatedLink] | None = None,
        tp_overlap_chunks: int = ParallelConfig.tp_overlap_chunks,
    ):
        self.layout = layout
        self.rank = rank
        self.tp_overlap_chunks = tp_overlap_chunks
        """`parallel.tp_overlap_chunks`: how tensor-parallel entries overlap their projections' GEMMs."""
        self.collective_timeout_s = collective_timeout_s
        self.network = dict(network or {})
        """Emulated links by group name (CPU runs: `parallel.emulate_network`); `pp_grad` takes `pp`'s."""
        self.sequence_parallel = sequence_parallel and layout.tp > 1
        self.counter = counter or TrafficCounter()
        self.tp_rank, self.dp_rank, self.pp_rank = layout.coordinates(rank)
        self.cp_rank, self.data_rank = self.dp_rank % layout.cp, self.dp_rank // layout.cp  # (data: batch rows)
        distributed = layout.world_size > 1
        self.tp = self._own_group("tp", layout.tp_groups(), distributed)
        self.dp = self._own_group("dp", layout.dp_groups(), distributed)
        self.pp = self._own_group("pp", layout.pp_groups(), distributed)
        # The same ranks again for the pipeline's backward messages: NCCL matches point-to-point
        # messages by order per communicator, and with pp = 2 both directions share a rank pair.
        self.pp_grad = self._own_group("pp_grad", layout.pp_groups(), distributed)
        self.data_tensor = self._own_group("data_tensor", layout.data_tensor_groups(), distributed)
        self.model = self._own_group("model", layout.model_groups(), distributed)
        self.ep = self._own_group("ep", layout.ep_groups(), distributed)
        self.expert_dp = self._own_group("expert_dp", layout.expert_dp_groups(), distributed)
        self.cp = self._own_group("cp", layout.cp_groups(), distributed)

    def _own_group(self, name: str, all_groups: list[list[int]], distributed: bool) -> Group:
        """Create every group of a kind (all ranks must, in the same order) and keep this rank's."""
        mine = None
        for ranks in all_groups:
            process_group = None
            if distributed and len(ranks) > 1:
                timeout = (
                    datetime.timedelta(seconds=self.collective_timeout_s)
                    if self.collective_timeout_s is not None
                    else None
                )
                process_group = dist.new_group(ranks, timeout=timeout, group_desc=name)
            if self.rank in ranks:
                link = self.network.get("pp" if name == "pp_grad" else name)
                mine = Group(name, tuple(ranks), ranks.index(self.rank), process_group, self.counter, link)
        assert mine is not None, f"rank {self.rank} is in no {name} group"
        return mine

    @classmethod
    def single(cls) -> ParallelState:
        return cls(Layout(1, 1, 1, 1, 1), rank=0)

    @classmethod
    def from_environment(cls, parallel_config, model_config, device_type: str = "cpu") -> ParallelState:
        """Read torchrun's RANK/WORLD_SIZE, check the layout, initialise torch.distributed
        (gloo on CPU, NCCL on CUDA) and build the groups, all with `parallel.collective_timeout_s`
        (or the backend's default)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        layout = layout_of(world_size, parallel_config, model_config)
        backend = "nccl" if device_type == "cuda" else "gloo"
        timeout_s = collective_timeout_seconds(parallel_config.collective_timeout_s, backend)
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        network = emulated_links(parallel_config.emulate_network)
        if network and device_type != "cpu":
            raise LayoutError(
                "parallel.emulate_network delays collectives on CPU runs only (a GPU job has a real network); "
                "remove it or run on CPU"
            )
        return cls(
            layout,
            rank,
            parallel_config.sequence_parallel,
            collective_timeout_s=timeout_s,
            network=network,
            tp_overlap_chunks=parallel_config.tp_overlap_chunks,
        )

    def describe(self) -> str:
        layout = self.layout
        return (
            f"rank {self.rank}/{layout.world_size}: tp {self.tp_rank}/{layout.tp}, dp {self.dp_rank}/{layout.dp}, "
            f"pp {self.pp_rank}/{layout.pp}, ep {self.ep.rank}/{layout.ep}"
            f"{f', cp {self.cp_rank}/{layout.cp}' if layout.cp > 1 else ''}"
            f"{', sequence parallel' if self.sequence_parallel else ''}"
        )
