"""Step time and MFU of a layout from a hardware profile.

Assumptions (stated, and printed by tools/plan.py):
* Compute: each pipeline stage's model FLOPs (`k3train/model/flops.py`, per layer) on its share
  of the tokens (`1/tp` of a micro-batch's work), at `efficiency` × the dense peak (default 0.45).
  `recompute: sublayer` runs every forward twice (4/3 of the FLOPs in hardware); `attn_res`
  recomputes only the small mix. The slowest stage sets the pipeline's pace.
* Pipeline: step = (M + (P−1)/V) × the slowest stage's micro-batch time (1F1B fill and drain,
  `bubble_formula`); the bubble is the second term.
* Communication: bytes per group and step from `k3train/planning/traffic_terms.py`, over the
  link the group crosses (rank order TP fastest, then DP, then PP: a group whose ranks are
  `stride` apart spans `stride × size` consecutive ranks, inside a node when that is at most
  `gpus_per_node`), at the ring factor `2(n−1)/n` for all-reduces. TP collectives sit on the
  critical path, except the overlapped entries of every mixer and MLP region
  (`parallel.tp_overlap_chunks` with plain torch projections: `TensorOverlap`, replayed per region and micro-batch by
  `overlap.exposed_tensor_entry_s`); EP all-to-alls too, unless `parallel.ep_overlap_chunks` overlaps them with the
  routed and shared experts' compute (`k3train/planning/overlap.py` replays that schedule per
  MoE layer and micro-batch: only what the experts cannot cover is exposed; the `nodes`
  transport's NVLink forwards, `ep.intranode`, are replayed with them, added to each chunk's
  exchange); pipeline hops overlap the other stages' compute except in
  fill and drain (2(P−1) exposed hops); DP gradient buckets overlap the backward of the last
  micro-batch, each from when it is full (`overlap.exposed_gradient_buckets_s`: what is still on
  the link when the backward ends is exposed); the ZeRO-1 all-gather after the optimizer step
  (`<group>.exchange`) is exposed. Any other `<group>.<part>` entry is exposed on its group's link.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from k3train.model import flops as F
from k3train.model.config import ModelConfig
from k3train.parallel.grad_reduce import DEFAULT_BUCKET_BYTES
from k3train.parallel.pipeline_schedule import PipelinePlan
from k3train.parallel.state import Layout
from k3train.planning.hardware import HardwareProfile
from k3train.planning.overlap import (
    LayerWork,
    even_buckets,
    exposed_alternating_halves_s,
    exposed_expert_exchange_s,
    exposed_gradient_buckets_s,
    exposed_tensor_entry_s,
    exposed_tensor_leave_s,
)

DEFAULT_EFFICIENCY = 0.45


def layer_training_flops(
    cfg: ModelConfig, layer: int, seq_length: int, document_lengths: Sequence[int] | None = None
) -> float:
    """Training FLOPs per token of decoder layer `layer` (3 × forward), AttnRes included;
    `document_lengths`: the documents of a sequence, each kept apart (`flops.py`)."""
    mixer = (
        F.mla_projection_flops(cfg) + F.mla_attention_flops(cfg, seq_length, document_lengths=document_lengths)
        if cfg.is_mla_layer(layer)
        else F.kda_projection_flops(cfg)
        + F.kda_short_conv_flops(cfg)
        + F.kda_chunk_flops_per_token(cfg, seq_length, document_lengths)
    )
    if cfg.is_moe_layer(layer):
        ffn = (
            F.routed_expert_flops(cfg)
            + F.shared_expert_flops(cfg)
            + F.latent_projection_flops(cfg)
            + F.router_flops(cfg)
        )
    else:
        ffn = F.dense_mlp_flops(cfg)
    attn_res = F.attn_res_flops(cfg) / (2 * cfg.num_hidden_layers + 1)
    return F.TRAINING_MULTIPLIER * (mixer + ffn + 2 * attn_res)


def layer_flops_table(cfg: ModelConfig, seq_length: int, document_lengths: Sequence[int] | None = None) -> list[float]:
    """Training FLOPs per token of every decoder layer, then (last entry) the output mix and head."""
    kinds: dict[tuple[bool, bool], float] = {}
    table = []
    for layer in range(cfg.num_hidden_layers):
        kind = (cfg.is_mla_layer(layer), cfg.is_moe_layer(layer))
        if kind not in kinds:
            kinds[kind] = layer_training_flops(cfg, layer, seq_length, document_lengths)
        table.append(kinds[kind])
    table.append(F.TRAINING_MULTIPLIER * (F.head_flops(cfg) + F.attn_res_flops(cfg) / (2 * cfg.num_hidden_layers + 1)))
    return table


def chunk_training_flops(
    cfg: ModelConfig, layer_range: tuple[int, int], seq_length: int, table: list[float] | None = None
) -> float:
    """Training FLOPs per token of the chunk `[start, end)` (the head on the last one)."""
    table = table or layer_flops_table(cfg, seq_length)
    start, end = layer_range
    return sum(table[start:end]) + (table[-1] if end == cfg.num_hidden_layers else 0.0)


def group_link(layout: Layout, group: str, gpus_per_node: int) -> str:
    """`nvlink` or `network`: whether one group of `group` fits in one node (rank order TP, DP, PP)."""
    if group == "ep.intranode":  # the `nodes` transport's forwards inside a node
        return "nvlink"
    group = group.split(".")[0]  # `dp.exchange`: a part of dp's traffic, on dp's link
    span = {
        "tp": layout.tp,
        "dp": layout.tp * layout.dp,
        "data_tensor": layout.tp * layout.dp,
        "ep": layout.ep,
        "expert_dp": layout.tp * layout.dp,
        "cp": layout.tp * layout.cp,
        "pp": layout.world_size,
    }.get(group, layout.world_size)
    if group == "pp" and layout.pp == 1:
        return "nvlink"
    return "nvlink" if span <= gpus_per_node else "network"


@dataclass(frozen=True)
class TensorOverlap:
    """The overlapped TP regions (every mixer and MLP region) of a step, per region and
    micro-batch. Entry: the all-gather's bytes (0 without sequence parallelism), the gradient's
    reduce-scatter (all-reduce) bytes, the pieces of the sequence. Leave (`leave_pieces` 0: not
    overlapped, under `model.recompute=sublayer`): the forward reduce-scatter (all-reduce) bytes,
    the backward all-gather bytes (0 without sequence parallelism), its pieces. Their bytes are
    part of the `tp` bytes given to `estimate_step_time`."""

    gather_bytes: float
    reduce_bytes: float
    pieces: int
    leave_reduce_bytes: float = 0.0
    leave_gather_bytes: float = 0.0
    leave_pieces: int = 0


@dataclass
class StepTime:
    """Seconds per step by term, and the derived rates."""

    compute_s: float
    bubble_s: float
    exposed_comm_s: dict[str, float]
    comm_bytes: dict[str, float]
    links: dict[str, str]
    tokens_per_step: int
    world_size: int
    model_flops_per_step: float
    peak_flops: float
    notes: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + sum(self.exposed_comm_s.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / (self.step_s * self.world_size * self.peak_flops)

    def shares(self) -> dict[str, float]:
        terms = {
            "compute": self.compute_s,
            "bubble": self.bubble_s,
            **{f"{group} comm": t for group, t in self.exposed_comm_s.items()},
        }
        return {name: value / self.step_s for name, value in terms.items()}


def estimate_step_time(
    cfg: ModelConfig,
    layout: Layout,
    plan: PipelinePlan,
    hardware: HardwareProfile,
    *,
    micro_batch_size: int,
    seq_length: int,
    micro_batches: int,
    precision: str,
    comm_bytes: dict[str, float],
    efficiency: float = DEFAULT_EFFICIENCY,
    gpus_per_node: int | None = None,
    document_lengths: Sequence[int] | None = None,
    ep_overlap_chunks: int = 0,
    ep_overlap_halves: bool = False,
    gradient_buckets: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    tp_overlap: TensorOverlap | None = None,
) -> StepTime:
    """The step time of `layout`; `comm_bytes` per group is what one rank sends in one step
    (`traffic_terms.layout_step_bytes`); `document_lengths`: the documents each sequence is
    packed with when they are kept apart (MLA's attention within each: fewer FLOPs).
    `gradient_buckets`: per data-parallel group, its buckets `(bytes, share of the backward done
    when full)` in launch order (`layout_traffic.gradient_bucket_schedule`); without them a
    group's bytes are taken as buckets of the reducer's default size, full at even shares.
    `tp_overlap`: the overlapped entries inside the `tp` bytes (None: every TP collective
    exposed). `ep_overlap_halves`: the chunked exchanges run as two alternating halves of each
    micro-batch (`parallel.ep_overlap_halves`)."""
    gpn = gpus_per_node or hardware.gpus_per_node
    peak = hardware.peak_flops(precision)
    rate = peak * efficiency
    tokens = micro_batch_size * seq_length
    recompute = 4 / 3 if cfg.recompute == "sublayer" else 1.0
    table = layer_flops_table(cfg, seq_length, document_lengths)
    stage_s = [
        sum(chunk_training_flops(cfg, r, seq_length, table) for r in plan.layer_ranges(rank))
        * tokens
        * recompute
        / layout.tp
        / layout.cp
        / rate
        for rank in range(layout.pp)
    ]
    per_micro_batch = max(stage_s)
    compute = micro_batches * per_micro_batch
    bubble = (layout.pp - 1) / layout.virtual_stages * per_micro_batch
    links = {group: group_link(layout, group, gpn) for group in comm_bytes}
    exposed: dict[str, float] = {}
    for group, nbytes in comm_bytes.items():
        bandwidth = (hardware.nvlink_gbps if links[group] == "nvlink" else hardware.internode_gbps) * 1e9
        seconds = nbytes / bandwidth
        if group == "pp":  # hops of the steady state hide behind the other stages' compute
            seconds *= 2 * (layout.pp - 1) / max(2 * micro_batches * layout.virtual_stages, 1)
        elif group in ("dp", "expert_dp", "data_tensor"):
            # The gradient buckets overlap the last micro-batch's backward (2/3 of its time), each
            # from the moment it is full; bytes beyond the given buckets are exposed.
            schedule = (gradient_buckets or {}).get(group)
            if schedule is None:
                buckets, rest = even_buckets(seconds, DEFAULT_BUCKET_BYTES / bandwidth), 0.0
            else:
                buckets = [(bucket_bytes / bandwidth, share) for bucket_bytes, share in schedule]
                rest = max(0.0, nbytes - sum(bucket_bytes for bucket_bytes, _ in schedule)) / bandwidth
            seconds = exposed_gradient_buckets_s(buckets, per_micro_batch * 2 / 3) + rest
        elif group == "tp" and tp_overlap is not None:
            seconds = _overlapped_tp_s(cfg, layout, plan, nbytes, bandwidth, tokens, rate, micro_batches, tp_overlap)
        elif group == "ep" and ep_overlap_chunks > 0:
            # The `nodes` transport's forwards inside the node are hops of the same chunks.
            inside = comm_bytes.get("ep.intranode", 0.0) / (hardware.nvlink_gbps * 1e9)
            seconds = _overlapped_ep_s(
                cfg,
                layout,
                plan,
                seconds + inside,
                tokens,
                rate,
                micro_batches,
                ep_overlap_chunks,
                ep_overlap_halves,
                table,
            )
        elif group == "ep.intranode" and ep_overlap_chunks > 0:
            seconds = 0.0  # replayed with the chunks' network hops under "ep"
        exposed[group] = seconds
    total_tokens = tokens * micro_batches * layout.data_parallel  # the cp ranks share their rows
    model_flops = (sum(table)) * total_tokens
    return StepTime(compute, bubble, exposed, comm_bytes, links, total_tokens, layout.world_size, model_flops, peak)


def mixer_entry_flops(cfg: ModelConfig, mla: bool, tp: int) -> float:
    """Forward FLOPs per token of the GEMMs an overlapped mixer entry runs on its gathered input,
    as if split over `tp` (the replicated low-rank projections, which every rank runs whole,
    count `tp` times): KDA's q, k, v, β and output gate (column-parallel), f_a and a low-rank
    gate's g_a (replicated); MLA's q (or the replicated q_a) and output gate (column-parallel)
    and the replicated kv_a."""
    d = cfg.hidden_size
    if mla:
        heads = cfg.num_attention_heads
        query = d * heads * cfg.qk_head_dim if cfg.q_lora_rank is None else tp * d * cfg.q_lora_rank
        gate = d * heads * cfg.v_head_dim if cfg.mla_use_output_gate else 0
        return 2 * (query + gate + tp * d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim))
    lac = cfg.linear_attn_config
    width, heads = lac.num_heads * lac.head_dim, lac.num_heads
    rank = cfg.kda_output_gate_rank
    gate = d * width if rank is None else tp * d * rank
    return 2 * (3 * d * width + d * heads + gate + tp * d * cfg.kda_gate_rank)


def _overlapped_tp_s(
    cfg: ModelConfig,
    layout: Layout,
    plan: PipelinePlan,
    tp_bytes: float,
    bandwidth: float,
    tokens: int,
    rate: float,
    micro_batches: int,
    regions: TensorOverlap,
) -> float:
    """The exposed part of a step's `tp_bytes` on the stage with the most TP regions (whose
    bytes the step counts): each region's overlapped entry replayed per micro-batch under the
    GEMMs of its input (`mixer_entry_flops`), its overlapped leave under its row-parallel GEMM
    (`region_leave_flops`), the rest (embedding, head, loss, Muon's gathers) exposed."""

    def stage_regions(rank: int) -> list[tuple[float, float]]:  # (entry, leave) forward FLOPs per token
        out = []
        for start, end in plan.layer_ranges(rank):
            for layer in range(start, end):
                mla = layer in cfg.full_attn_layer_set
                out.append((mixer_entry_flops(cfg, mla, layout.tp), mixer_leave_flops(cfg, mla)))
                if not cfg.is_moe_layer(layer):
                    out.append((F.dense_mlp_flops(cfg) * 2 / 3, F.dense_mlp_flops(cfg) / 3))
                elif cfg.num_shared_experts > 0:  # gate and up: 2/3 of a GLU; down 1/3
                    out.append((F.shared_expert_flops(cfg) * 2 / 3, F.shared_expert_flops(cfg) / 3))
        return out

    stage = max((stage_regions(rank) for rank in range(layout.pp)), key=len)
    share = tokens / layout.tp / layout.cp / rate  # seconds per forward FLOP per token of this rank's rows
    per_region_bytes = regions.gather_bytes + regions.reduce_bytes
    if regions.leave_pieces:
        per_region_bytes += regions.leave_reduce_bytes + regions.leave_gather_bytes
    exposed = max(0.0, tp_bytes - micro_batches * len(stage) * per_region_bytes) / bandwidth
    per_micro_batch = 0.0
    for entry_flops, leave_flops in stage:
        per_micro_batch += exposed_tensor_entry_s(
            regions.gather_bytes / bandwidth, regions.reduce_bytes / bandwidth, entry_flops * share, regions.pieces
        )
        if regions.leave_pieces:
            per_micro_batch += exposed_tensor_leave_s(
                regions.leave_reduce_bytes / bandwidth,
                regions.leave_gather_bytes / bandwidth,
                leave_flops * share,
                regions.leave_pieces,
            )
    return exposed + micro_batches * per_micro_batch


def mixer_leave_flops(cfg: ModelConfig, mla: bool) -> float:
    """Forward FLOPs per token of a mixer's row-parallel output projection (whole, as if split
    over `tp`): KDA's and MLA's `o_proj`."""
    if mla:
        return 2 * cfg.num_attention_heads * cfg.v_head_dim * cfg.hidden_size
    lac = cfg.linear_attn_config
    return 2 * lac.num_heads * lac.head_dim * cfg.hidden_size


def _overlapped_ep_s(
    cfg: ModelConfig,
    layout: Layout,
    plan: PipelinePlan,
    ep_s: float,
    tokens: int,
    rate: float,
    micro_batches: int,
    chunks: int,
    halves: bool = False,
    table: list[float] | None = None,
) -> float:
    """The exposed part of a step's `ep_s` seconds of expert all-to-alls on the stage with the most
    MoE layers (whose bytes the step counts), its layers and micro-batches alike. `halves`
    (`parallel.ep_overlap_halves`): each model chunk of that stage replayed as two alternating
    halves (`overlap.exposed_alternating_halves_s`), its layers' compute from `table`
    (`layer_flops_table`)."""

    def moe_count(ranges) -> int:
        return sum(cfg.is_moe_layer(layer) for start, end in ranges for layer in range(start, end))

    ranges = max((plan.layer_ranges(rank) for rank in range(layout.pp)), key=moe_count)
    moe_layers = moe_count(ranges)
    if moe_layers == 0 or micro_batches == 0:
        return ep_s
    share = tokens / layout.tp / layout.cp / rate  # seconds per forward FLOP per token of this rank's rows
    exchange_s = ep_s / (moe_layers * micro_batches)
    experts_s, shared_s = F.routed_expert_flops(cfg) * share, F.shared_expert_flops(cfg) * share
    if halves:  # each chunk's layers in order: one half's exchanges under the other half's work
        assert table is not None, "the alternating halves are replayed from the layers' FLOPs"

        def work(layer: int) -> LayerWork:
            forward_s = table[layer] / F.TRAINING_MULTIPLIER * share
            if not cfg.is_moe_layer(layer):
                return LayerWork(forward_s)
            return LayerWork(forward_s - experts_s - shared_s, exchange_s, experts_s, shared_s)

        per_micro_batch = sum(
            exposed_alternating_halves_s([work(layer) for layer in range(start, end)], chunks) for start, end in ranges
        )
        return per_micro_batch * micro_batches
    per_layer = exposed_expert_exchange_s(exchange_s, experts_s, shared_s, chunks)
    return per_layer * moe_layers * micro_batches


__all__ = [
    "StepTime",
    "TensorOverlap",
    "estimate_step_time",
    "layer_training_flops",
    "chunk_training_flops",
    "group_link",
    "DEFAULT_EFFICIENCY",
]
