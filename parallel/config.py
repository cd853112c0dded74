"""Parallel settings (the `parallel:` section of a recipe) and the layout rules that need no
process group: which sizes are valid, and which parallel sizes must divide which model sizes.

Torch-free, so a recipe is checked before torch loads. The rules that need the world size live
in `state.py` (`resolve_layout`); how layers are split into pipeline chunks lives in
`pipeline_schedule.py` (`partition_layers`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from k3train.config.recipe import ConfigError, check

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "LayoutError",
    "ModelSplitSizes",
    "ParallelConfig",
    "check_context_split",
    "check_model_split",
    "check_pipeline_sizes",
    "collective_timeout_seconds",
    "divisors",
]

# The bound on one collective when `parallel.collective_timeout_s` is 0, per backend.
# gloo (CPU): collectives of CPU runs take milliseconds to seconds; the longest legitimate wait is
# a peer writing a checkpoint or evaluating while the others wait at the next collective, which on
# a CPU-sized model is well under 5 minutes. NCCL (GPU): a peer may be autotuning Triton kernels on
# its first step or writing its shards of a large checkpoint (hundreds of GB at a few GB/s), which
# can take over 10 minutes (torch's own NCCL default); 20 minutes covers that while bounding what a
# hung rank costs the whole job.
DEFAULT_COLLECTIVE_TIMEOUT_S = MappingProxyType({"gloo": 300.0, "nccl": 1200.0})


def collective_timeout_seconds(configured: float, backend: str) -> float:
    """The timeout every process group gets: `parallel.collective_timeout_s`, or the backend's
    default when it is 0."""
    return (
        configured
        if configured > 0
        else DEFAULT_COLLECTIVE_TIMEOUT_S.get(backend, DEFAULT_COLLECTIVE_TIMEOUT_S["gloo"])
    )


class LayoutError(ConfigError):
    """A parallel layout that cannot run; the message names the sizes and what would fit."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_pipeline_sizes(pp: int, virtual_stages: int) -> None:
    """Raise LayoutError unless `pp` and `virtual_stages` are at least 1, and interleaving
    (virtual_stages > 1) has stages to interleave (pp > 1)."""
    for name, size in (("pp", pp), ("virtual_stages", virtual_stages)):
        if size < 1:
            raise LayoutError(f"parallel.{name} must be at least 1, got {size}")
    if virtual_stages > 1 and pp == 1:
        raise LayoutError(
            f"parallel.virtual_stages={virtual_stages} needs parallel.pp > 1 (interleaving splits "
            f"pipeline stages); set parallel.pp or parallel.virtual_stages=1"
        )


@dataclass(frozen=True)
class ModelSplitSizes:
    """The model's counts that a parallel layout must divide: heads and vocabulary by tp, experts
    by ep, layers into pipeline chunks."""

    mla_heads: int
    kda_heads: int
    vocab_size: int
    num_experts: int
    num_layers: int

    @classmethod
    def of(cls, model_config) -> ModelSplitSizes:
        """From a `ModelConfig` (read by attribute: this module stays torch- and model-free)."""
        return cls(
            model_config.num_attention_heads,
            model_config.linear_attn_config.num_heads,
            model_config.vocab_size,
            model_config.num_experts,
            model_config.num_hidden_layers,
        )


def check_model_split(tp: int, ep: int, model: ModelSplitSizes) -> None:
    """Raise LayoutError unless tp divides the heads and the vocabulary and ep divides the experts
    (a count of 0, such as no experts, needs no split)."""
    for what, count, size_name, size in (
        ("model.num_attention_heads (MLA heads)", model.mla_heads, "parallel.tp", tp),
        ("model.linear_attn_config.num_heads (KDA heads)", model.kda_heads, "parallel.tp", tp),
        ("model.vocab_size", model.vocab_size, "parallel.tp", tp),
        ("model.num_experts", model.num_experts, "parallel.ep", ep),
    ):
        if count and count % size:
            raise LayoutError(
                f"{what}={count} is not divisible by {size_name}={size}; "
                f"{size_name} must divide {count}: one of {[d for d in divisors(count) if d <= 64]}"
            )


def check_context_split(
    cp: int, seq_length: int, short_conv_kernel_size: int, tp: int = 1, sequence_parallel: bool = False
) -> None:
    """Raise LayoutError unless a sequence of `seq_length` tokens splits into the 2 * cp
    load-balanced pieces of context parallelism (each at least as long as a short convolution's
    tail, and dividing over tp under sequence parallelism)."""
    if cp == 1:
        return
    pieces = 2 * cp
    if seq_length % pieces:
        fits = [c for c in range(1, 65) if seq_length % (2 * c) == 0]
        raise LayoutError(
            f"data.seq_length={seq_length} does not split into 2*parallel.cp = {pieces} equal pieces "
            f"(each cp rank holds a front and a back piece); use a seq_length divisible by {pieces} "
            f"or parallel.cp from {fits}"
        )
    piece = seq_length // pieces
    if piece < short_conv_kernel_size - 1:
        raise LayoutError(
            f"data.seq_length={seq_length} over parallel.cp={cp} gives pieces of {piece} tokens, fewer "
            f"than the short convolution's tail of {short_conv_kernel_size - 1}; lower parallel.cp"
        )
    if sequence_parallel and tp > 1 and (2 * piece) % tp:
        raise LayoutError(
            f"data.seq_length={seq_length} over parallel.cp={cp} leaves {2 * piece} tokens per rank, "
            f"not divisible by parallel.tp={tp} (sequence parallelism)"
        )


EMULATED_GROUPS = ("tp", "cp", "dp", "pp", "ep", "expert_dp", "data_tensor", "model")


def check_overlap_halves(parallel: ParallelConfig, micro_batch_size: int, recompute: str) -> None:
    """`parallel.ep_overlap_halves` needs what it alternates: chunked exchanges, two sequences per
    micro-batch, and sublayers that are not recomputed whole (a recomputed sublayer runs its
    exchanges inside autograd's checkpoint, where the other half cannot run)."""
    if not parallel.ep_overlap_halves:
        return
    problems = [
        (parallel.ep_overlap_chunks >= 1, "parallel.ep_overlap_chunks >= 1 (the halves run the chunked exchange)"),
        (micro_batch_size >= 2, f"train.micro_batch_size >= 2 (got {micro_batch_size}: a half is whole sequences)"),
        (recompute != "sublayer", "model.recompute other than 'sublayer'"),
    ]
    for ok, need in problems:
        if not ok:
            raise ConfigError(f"parallel.ep_overlap_halves=true needs {need}; set it, or ep_overlap_halves=false")


def check_emulated_network(emulate_network: dict[str, list[float]]) -> None:
    """Raise ConfigError unless every entry names a group and gives [GB/s > 0, latency µs >= 0]."""
    for name, link in emulate_network.items():
        if name not in EMULATED_GROUPS:
            raise ConfigError(
                f"parallel.emulate_network: unknown group '{name}'; groups are {', '.join(EMULATED_GROUPS)}"
            )
        if (
            len(link) != 2
            or not (link[0] > 0 and math.isfinite(link[0]))
            or not (link[1] >= 0 and math.isfinite(link[1]))
        ):
            raise ConfigError(
                f"parallel.emulate_network.{name} must be [bandwidth GB/s > 0, latency µs >= 0], got {link}"
            )


@dataclass
class ParallelConfig:
    """How the job is split across processes. The values are checked here; whether they fit the
    model is checked with the whole job (`JobConfig.validate`), and whether they fit the world
    size by `resolve_layout` at start-up."""

    tp: int = 1
    """Tensor-parallel size (attention heads and expert/MLP widths split across ranks)."""
    pp: int = 1
    """Pipeline-parallel size (stages of consecutive decoder layers)."""
    dp: int = 0
    """Data-parallel size (distinct batch rows); 0 means whatever is left of the world size
    (world / (tp * pp * cp))."""
    ep: int = 1
    """Expert-parallel size for the MoE layers, carved out of dp * tp; must divide model.num_experts."""
    cp: int = 1
    """Context-parallel size: every sequence is split over cp ranks, each holding a front and a
    back piece (2 * cp pieces, load-balanced for causal attention); data.seq_length must divide
    by 2 * cp. The cp ranks hold the same weights: gradients are averaged over dp * cp."""
    virtual_stages: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B when > 1; needs pp > 1)."""
    sequence_parallel: bool = False
    """Split the sequence dimension of norms and residual activations across the TP ranks."""
    tp_overlap_chunks: int = 0
    """Tensor-parallel regions whose projections are plain torch linears (every KDA and MLA
    mixer, the dense MLP and the shared experts): overlap the entry's and the leave's
    collectives with those GEMMs. With sequence parallelism the entry's all-gather runs in this
    many pieces along the sequence, each piece's GEMMs while the next is on the wire; in backward
    the input gradient's reduce-scatter (all-reduce without SP) runs under the weight-gradient
    GEMMs. The leave's row-parallel product runs in as many pieces, each piece's reduce-scatter
    (all-reduce) under the next piece's GEMM, and in backward (SP) the output gradient's
    all-gather in pieces under the input-gradient GEMMs; under `model.recompute=sublayer` the
    leaves stay unfused (a recomputed fused leave would run its collectives again).
    0 (default): each collective, then its GEMMs. Off by default because on CPU (gloo, the
    debug model) it measured no gain: its GEMMs are too short to hide a piece (docs/traffic.md);
    the GPU measurement is pending. The planner prices it where the projections are torch's
    (docs/planning.md). parallel/tensor_overlap.py."""
    zero1: bool = True
    """Shard the optimizer state across the data-parallel ranks (ZeRO-1)."""
    pipeline_layers: list[int] | None = None
    """Decoder layers per pipeline chunk, overriding the even split: pp * virtual_stages entries in
    chunk order (chunk c runs on rank c mod pp), each at least 1, summing to
    model.num_hidden_layers; null splits evenly."""
    expert_dispatch: Literal["balanced", "capacity"] = "balanced"
    """Fixed-size expert dispatch: 'balanced' replicates overloaded experts onto underloaded
    ranks; 'capacity' drops slots beyond capacity_factor."""
    capacity_factor: float = 1.25
    """Receive capacity as a multiple of the even share: 'balanced', rows per destination rank
    (tokens * top_k each); 'capacity', slots per (source, destination) pair (tokens * top_k / ep)."""
    max_replicas_per_rank: int = 2
    """'balanced' dispatch: the most replicated experts one rank hosts in a micro-batch."""
    ep_replica_planning: Literal["online", "step"] = "online"
    """'balanced' dispatch, when replicas are placed. 'online': every micro-batch plans its own from
    its all-gathered loads and fetches their weights (a fixed-shape all-to-all of ep *
    max_replicas_per_rank expert matrices per rank; gradients return home in backward), so no
    routing, not even the first step's, finds its hot experts without replicas. 'step': one
    placement per step planned from the previous step's loads, weights fetched once per step (less
    replica traffic; the first step and a sudden shift of the routing can drop, counted)."""
    ep_top_up_replicas: int = 0
    """'balanced' dispatch with ep_replica_planning 'step': this many more replica slots per rank,
    planned per micro-batch from its own loads where the step's placement would leave a rank past
    capacity_factor times the even share (the first step, a shift of the routing), and fetched for
    that micro-batch only (gradients home in its backward). Where the placement suffices no
    top-up is planned and, with ep_transport 'exact', no weights travel. 0: none."""
    ep_transport: Literal["auto", "spread", "relay", "padded", "splits", "exact", "nodes"] = "auto"
    """'balanced' dispatch, how token rows cross the EP group. 'auto': 'splits' on gloo (CPU, where
    reading split sizes costs no device synchronisation); on GPUs 'exact' where NVSHMEM is
    installed (torch's CUDA wheels ship it; a plan assumes it), 'spread' where it is not. 'spread': two
    fixed-shape all-to-alls that spread each source's rows evenly over all ranks and forward them
    (no host read; no drop while every destination is within capacity_factor of the even share,
    whatever the (source, destination) pairs; about (1 + capacity_factor) times the unpadded rows
    plus ep rows per pair). 'splits': exactly the
    rows that exist, the receive buffer sized to what arrives (never drops; on GPUs the split sizes
    are read on the host, a device synchronisation per dispatch). 'exact': exactly the rows that
    exist on the wire, received into a fixed [capacity_factor * tokens * top_k] buffer, the split
    sizes kept as tensors (NVSHMEM's device-split all-to-all on CUDA where it is installed, read on
    the host otherwise; static shapes, drops only past that capacity). 'relay': two fixed-shape
    all-to-alls (a pair's overflow goes through other ranks' spare rows; wire within
    capacity_factor of the unpadded rows, no host read; drops, and counts, beyond that bound).
    'padded': one all-to-all of tokens * top_k rows per pair (ep times the rows: a reference with
    a fixed [capacity_factor * tokens * top_k] receive buffer). 'nodes': a token's row crosses
    between nodes (gpus_per_node) once per destination node and is forwarded inside the node;
    combine adds the outputs at the node before they cross back (fixed buffers, split sizes as
    tensors as for 'exact'; drops only past a destination's or a gateway's capacity). docs/expert_parallel.md."""
    ep_overlap_chunks: int = 0
    """'balanced' dispatch: overlap the expert all-to-alls with compute. Each MoE layer's tokens go
    in this many chunks: every chunk's dispatch is launched at once, the shared experts run while
    the first is on the wire, each chunk's experts while the next chunk's rows (and the previous
    chunk's combine) travel; backward runs the same overlap in reverse. 0 (default): dispatch,
    experts, combine, then the shared experts, each collective waited for at once. The same
    losses either way (rows are independent; float64 equal to rounding). docs/expert_parallel.md."""
    ep_overlap_halves: bool = False
    """With ep_overlap_chunks: each micro-batch runs as two halves of its sequences whose layers
    alternate (one half's mixer, then the other's, each half's MoE between), so that one half's
    expert all-to-alls travel while the other half computes its attention and experts; backward
    alternates the same way. Needs train.micro_batch_size >= 2 and model.recompute other than
    'sublayer'. The same losses (sequences are independent; float64 equal to rounding).
    docs/expert_parallel.md."""
    gpus_per_node: int = 0
    """GPUs (ranks) per node, for ep_transport 'nodes': ranks r and r' share a node when
    r // gpus_per_node equals r' // gpus_per_node. 0: torchrun's local world size."""
    collective_timeout_s: float = 0.0
    """Seconds any collective may wait for its peers before this rank exits with one line naming
    the group (a rank that died or stopped answering); 0 means the backend's default: 300 on
    gloo (CPU), 1200 on NCCL (a first-step kernel autotune or a large checkpoint write fits in it).
    Applies to the default group and every sub-group. On NCCL the watchdog enforces it
    (TORCH_NCCL_ASYNC_ERROR_HANDLING must not be 0)."""

    emulate_network: dict[str, list[float]] = field(default_factory=dict)
    """CPU runs only: delay each collective of a group as a link of that bandwidth and latency
    would, `{group: [GB/s, latency µs]}` (groups: tp, cp, dp, pp, ep, expert_dp, data_tensor,
    model), e.g. `{ep: [25, 10]}`; a collective then completes no earlier than `latency + bytes /
    bandwidth` after every rank has entered it (and the link is free), so a gloo run shows the communication overlap hides (the step
    line's `comm` and metrics.jsonl's `exposed_comm_s`). Pipeline point-to-point hops are timed
    but not delayed. Empty: collectives run at the machine's own speed."""

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range field."""
        check(
            [
                (value >= 1, f"parallel.{name} must be at least 1, got {value}")
                for name, value in (("tp", self.tp), ("ep", self.ep), ("cp", self.cp))
            ]
        )
        check_pipeline_sizes(self.pp, self.virtual_stages)
        check_emulated_network(self.emulate_network)
        check(
            [
                (self.dp >= 0, f"parallel.dp must be 0 (the rest of the world size) or positive, got {self.dp}"),
                (
                    self.tp_overlap_chunks >= 0,
                    f"parallel.tp_overlap_chunks must be 0 (no overlap) or a number of pieces, got {self.tp_overlap_chunks}",
                ),
                (
                    self.ep_overlap_chunks >= 0,
                    f"parallel.ep_overlap_chunks must be 0 (no overlap) or a number of chunks, got {self.ep_overlap_chunks}",
                ),
                (
                    self.ep_top_up_replicas == 0
                    or (self.ep_top_up_replicas > 0 and self.ep_replica_planning == "step"),
                    f"parallel.ep_top_up_replicas={self.ep_top_up_replicas}: top-up slots follow a step placement; "
                    "set parallel.ep_replica_planning=step, or ep_top_up_replicas=0",
                ),
                (self.capacity_factor > 0, f"parallel.capacity_factor must be positive, got {self.capacity_factor}"),
                (
                    self.max_replicas_per_rank >= 1,
                    f"parallel.max_replicas_per_rank must be at least 1, got {self.max_replicas_per_rank}",
                ),
                (
                    math.isfinite(self.collective_timeout_s) and self.collective_timeout_s >= 0,
                    f"parallel.collective_timeout_s must be 0 (the backend's default) or a positive number of seconds, "
                    f"got {self.collective_timeout_s}",
                ),
            ]
        )
