"""Memory of one pipeline rank: weights, gradients, optimizer state and activations.

The static part is read from the rank's model built on the meta device by the job's own code
(`build_planning_rank`: TP shards, EP home experts, pipeline chunks), so parameter counts and the
Muon/AdamW split are exact. The activation part is a per-token formula of the config, one term per
component, counted from the tensors autograd saves on the PyTorch path (what
`tests/unit/test_plan_memory.py` measures with `saved_tensors_hooks`): the coefficients are listed
in `docs/planning.md` with what they stand for. It is multiplied by the micro-batches (chunks)
the schedule keeps in flight at its peak, read from the schedule's own step list.

Precision: the weights are the built parameters' bytes (fp32, or bf16 under
`train.weights=bf16_with_fp32_master_shards`); the gradients are `p.grad` in the parameter's
dtype plus the reducer's bucket buffers (fp32 weights), or the reducer's persistent buffers in
`train.grad_dtype` (bf16 weights); the fp32 masters are the owned parameters' (bf16 weights
only); the optimizer state is fp32 for the owned parameters. Activations are saved in 2 bytes
under bf16 and fp8 (the router, AttnRes and loss parts compute in fp32 and are counted at 4).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from k3train.config import JobConfig
from k3train.kernels.grouped_gemm import expected_padding_rows
from k3train.model.config import ModelConfig
from k3train.optim.builder import route_parameters
from k3train.parallel.mixed_precision import MainGradReducer
from k3train.parallel.pipeline import theoretical_peak_blocks
from k3train.parallel.pipeline_schedule import PipelinePlan, schedule_steps
from k3train.parallel.state import Layout
from k3train.planning.context import context_extra_activation_bytes
from k3train.training.build import RankJob

GIB = 2**30
AttentionKernel = Literal["flash", "math"]


@dataclass(frozen=True)
class SavedElementBytes:
    """Bytes per saved element of each component where they are not all of one dtype: under
    bf16 on the PyTorch path (the CPU) the GEMM inputs are saved in bf16 and what the kernels
    compute in fp32 (KDA's chunk path, SiTU-GLU's factors, the norms) in fp32. Read off
    `saved_tensors_hooks` on the debug model with bf16 weights (bytes saved ÷ the fp32 path's
    elements, per component; the same within 1% at width ×2 and sequence ×2, MLA within 3%)."""

    kda: float
    mla: float
    glu: float
    moe: float
    residual: float


TORCH_PATH_BF16 = SavedElementBytes(kda=3.61, mla=2.15, glu=3.54, moe=3.58, residual=2.0)


@dataclass(frozen=True)
class ActivationShape:
    """What one micro-batch looks like on one rank: tokens inside a TP region (full sequence)
    and outside it (the sequence shard under SP), and the element size (`saved`, where set, per
    component instead)."""

    tokens: int  # b·s
    tp: int
    sequence_parallel: bool
    element_bytes: int  # 4 fp32, 2 bf16
    saved: SavedElementBytes | None = None
    expert_groups: int = 0  # local expert groups padded with zero rows (CPU bf16, kernels/grouped_gemm.py)

    @property
    def outside_tokens(self) -> float:
        return self.tokens / self.tp if self.sequence_parallel and self.tp > 1 else self.tokens

    def bytes_of(self, component: Literal["kda", "mla", "glu", "moe", "residual"]) -> float:
        return float(self.element_bytes) if self.saved is None else getattr(self.saved, component)


def activation_shape(config: JobConfig, tokens: int, tp: int, sequence_parallel: bool, ep: int = 1) -> ActivationShape:
    """The micro-batch shape of `config`'s precision: 4 bytes under fp32; under bf16 and fp8
    2 bytes on CUDA (the kernels' bf16 saves: an assumption no GPU run has measured yet), and
    on the CPU the PyTorch path's measured mix (`TORCH_PATH_BF16`), its `num_experts / ep`
    local expert groups padded to repeating GEMM shapes."""
    train = config.train
    if train.precision == "fp32":
        return ActivationShape(tokens, tp, sequence_parallel, 4)
    if train.device == "cpu":
        groups = config.model.num_experts // ep if config.model.num_experts else 0
        return ActivationShape(tokens, tp, sequence_parallel, 2, TORCH_PATH_BF16, groups)
    return ActivationShape(tokens, tp, sequence_parallel, 2)


def expert_padding_bytes(cfg: ModelConfig, shape: ActivationShape) -> float:
    """Saved bytes of the zero rows the CPU bf16 experts pad their groups with, per MoE layer:
    `expected_padding_rows` per group at the mean slots per group (routing taken as random), each
    row saving
    the latent input and the down projection's input in bf16 and SiTU-GLU's four fp32 factors (or,
    with `model.recompute_glu`, its bf16 gate and up)."""
    slots = shape.outside_tokens * cfg.num_experts_per_token
    if not shape.expert_groups or slots <= 0:
        return 0.0
    rows = shape.expert_groups * expected_padding_rows(slots / shape.expert_groups)
    inner = cfg.moe_intermediate_size
    factors = 2 * inner * shape.element_bytes if cfg.recompute_glu and cfg.hidden_act == "situ" else 4 * inner * 4
    return rows * ((cfg.expert_width + inner) * shape.element_bytes + factors)


def kda_elements_per_token(cfg: ModelConfig, tp: int) -> float:
    """KDA on the PyTorch chunk path (its written-out backward), per token: its input (h); about
    22.5 head-width tensors (the q/k/v/gate projections and short convolutions' outputs, the
    normalised q/k, the decay gate, the kernel's chunked inputs, tile factors, u and outputs, the
    gated output norm); two `C×C` matrices per head (the UT transform and the query Gram); two
    `d×d` per head and chunk (the entering states and the chunk transitions) and `d` per token.
    Fitted to `saved_tensors_hooks` counts while varying one dimension at a time (within 1%);
    chunks of one diagonal tile (small decays, the common case)."""
    lac = cfg.linear_attn_config
    heads = lac.num_heads // tp
    width = heads * lac.head_dim
    return (
        cfg.hidden_size
        + 22.5 * width
        + 2 * heads * lac.chunk_size
        + 2 * heads * lac.head_dim**2 / lac.chunk_size
        + lac.head_dim
    )


def mla_elements_per_token(cfg: ModelConfig, tp: int, seq_length: int, kernel: AttentionKernel) -> float:
    """Gated MLA, per token: its input (h), the low-rank latents and their norms' outputs
    (2·(q_lora + kv_lora)); per head q and k (2·qk), v zero-padded to the q/k head dim and the
    padded attention output (2·qk: training takes SDPA's fused kernel that way), the gate's
    sigmoid and the gated output (2·v) and the log-sum-exp (1); the math SDPA path (`kernel`
    "math", no longer taken in training) would save the `T×T` attention weights as well."""
    heads = cfg.num_attention_heads // tp
    latent = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank
    per_head = 3 * cfg.qk_head_dim + max(cfg.qk_head_dim, cfg.v_head_dim) + 2 * cfg.v_head_dim + 1
    scores = heads * seq_length if kernel == "math" else 0
    return cfg.hidden_size + 2 * latent + heads * per_head + scores


def glu_elements_per_token(hidden: int, intermediate: float) -> float:
    """A GLU MLP: its input and 5 intermediate-width tensors (SiTU-GLU's saved factors, which
    overwrite the gate/up outputs, and the down projection's input)."""
    return hidden + 5 * intermediate


def moe_elements_per_token(cfg: ModelConfig, tp: int) -> tuple[float, float]:
    """(routed part on this rank's tokens, shared experts inside the TP region) of a LatentMoE:
    router scores (E); the latent input and the normalised routed sum (2l); per slot the
    gathered latent and the expert output (2l), SiTU-GLU's factors and the down projection's
    input (5·I) and the routing weight, index and order scalars (8); the shared experts a GLU of
    width `n_shared·I` (its input, h, is the region's)."""
    k, latent, inner = cfg.num_experts_per_token, cfg.expert_width, cfg.moe_intermediate_size
    routed = cfg.num_experts + 2 * latent + k * (2 * latent + 5 * inner + 8)
    shared = (
        glu_elements_per_token(cfg.hidden_size, cfg.num_shared_experts * inner / tp) if cfg.num_shared_experts else 0
    )
    return routed, shared


def glu_recompute_saving(cfg: ModelConfig, shape: ActivationShape) -> float:
    """Bytes per intermediate element `model.recompute_glu` saves: SiTU-GLU's four factors (fp32
    on the PyTorch path and in fp32 runs; the compute dtype assumed on CUDA) replaced by the gate
    and up outputs in the compute dtype."""
    if not cfg.recompute_glu or cfg.hidden_act != "situ":
        return 0.0
    factor = 4 if shape.saved is not None or shape.element_bytes == 4 else shape.element_bytes
    return 4 * factor - 2 * shape.element_bytes


def layer_activation_bytes(
    cfg: ModelConfig, layer: int, shape: ActivationShape, seq_length: int, kernel: AttentionKernel = "flash"
) -> float:
    """Saved bytes of decoder layer `layer` for one micro-batch under `cfg.recompute`."""
    h, tp = cfg.hidden_size, shape.tp
    inside, outside = shape.tokens, shape.outside_tokens
    # Residual path: the partial sum handed to each sublayer (2 per layer); without recompute each
    # AttnRes mix's output and its normalised copy, saved by the norm that follows (2h more per
    # mix, fp32; the mix itself keeps only per-token scalars besides its sources).
    residual = 2 * h * outside * shape.bytes_of("residual")
    if cfg.recompute == "none" and cfg.attn_res != "none":
        residual += 4 * h * outside * 4
    if cfg.recompute == "sublayer":
        return residual
    if cfg.is_mla_layer(layer):
        mixer = mla_elements_per_token(cfg, tp, seq_length, kernel) * shape.bytes_of("mla")
    else:
        mixer = kda_elements_per_token(cfg, tp) * shape.bytes_of("kda")
    saving = glu_recompute_saving(cfg, shape)
    if cfg.is_moe_layer(layer):
        routed, shared = moe_elements_per_token(cfg, tp)
        ffn = routed * outside * shape.bytes_of("moe") + shared * inside * shape.bytes_of("glu")
        inner = cfg.moe_intermediate_size
        ffn -= saving * (cfg.num_experts_per_token * inner * outside + cfg.num_shared_experts * inner / tp * inside)
        ffn += expert_padding_bytes(cfg, shape)
    else:
        ffn = glu_elements_per_token(h, cfg.intermediate_size / tp) * inside * shape.bytes_of("glu")
        ffn -= saving * cfg.intermediate_size / tp * inside
    return residual + mixer * inside + ffn


def sublayer_recompute_peak_bytes(
    cfg: ModelConfig, layers: range, shape: ActivationShape, seq_length: int, kernel: AttentionKernel = "flash"
) -> float:
    """`recompute: sublayer` rebuilds one sublayer at a time in backward: the largest one's
    activations are live once on top of the saved inputs."""
    if cfg.recompute != "sublayer" or not len(layers):
        return 0.0
    full = dataclasses.replace(cfg, recompute="attn_res")
    return max(layer_activation_bytes(full, layer, shape, seq_length, kernel) for layer in layers)


def ends_bytes(cfg: ModelConfig, shape: ActivationShape, embedding: bool, head: bool) -> float:
    """The embedding output and ids; the final mix and norm, and the fp32 softmax of the local
    vocabulary shard for the loss."""
    total = 0.0
    if embedding:
        # Its output is saved by the first mix, and once more by the first norm unless recomputed.
        copies = 1 if cfg.recompute == "sublayer" else 2
        total += shape.outside_tokens * copies * cfg.hidden_size * shape.bytes_of("residual") + shape.tokens * 8
    if head:
        total += shape.outside_tokens * 4 * cfg.hidden_size * shape.bytes_of("residual")
        total += shape.tokens * (cfg.vocab_size / shape.tp) * 4
    return total


def chunk_activation_bytes(
    cfg: ModelConfig,
    layer_range: tuple[int, int],
    shape: ActivationShape,
    seq_length: int,
    kernel: AttentionKernel = "flash",
) -> float:
    """One micro-batch's saved activations in one pipeline chunk `[start, end)`."""
    start, end = layer_range
    total = sum(layer_activation_bytes(cfg, layer, shape, seq_length, kernel) for layer in range(start, end))
    return total + ends_bytes(cfg, shape, start == 0, end == cfg.num_hidden_layers)


def peak_in_flight(plan: PipelinePlan, rank: int, micro_batches: int) -> list[int]:
    """For each virtual stage of `rank`: micro-batches whose forward has run and backward not yet,
    at the step where the rank holds the most layers' activations (from the schedule's own list)."""
    weights = tuple(end - start for start, end in plan.layer_ranges(rank))
    return list(_peak_in_flight(plan.pp, plan.virtual_stages, rank, micro_batches, weights))


@functools.lru_cache(maxsize=4096)
def _peak_in_flight(
    pp: int, virtual_stages: int, rank: int, micro_batches: int, weights: tuple[int, ...]
) -> tuple[int, ...]:
    if virtual_stages == 1:  # 1F1B: the warmup forwards plus one
        return (min(pp - rank, micro_batches),)
    live = [0] * virtual_stages
    best, best_load = list(live), -1
    for step in schedule_steps(pp, virtual_stages, rank, micro_batches):
        live[step.virtual_stage] += 1 if step.kind == "forward" else -1
        load = sum(n * w for n, w in zip(live, weights))
        if load > best_load:
            best, best_load = list(live), load
    return tuple(best)


@dataclass(frozen=True)
class RankMemory:
    """Bytes of one pipeline rank, by term."""

    pp_rank: int
    parameters: int
    weights: float
    gradients: float
    gradient_buffers: float
    """Bucket buffers of the reduction (fp32 weights: allocated per step beside `p.grad`) and the
    reduce-scattered segments, alive from their bucket's launch to the end of the reduction."""
    master: float
    """fp32 master weights of the owned parameters (bf16 weights only)."""
    optimizer: float
    activations: float
    pipeline_blocks: float
    expert_buffers: float
    in_flight: tuple[int, ...]
    host_activations: float = 0.0
    """`train.offload_activations`: the saved activations of the micro-batches in flight, in host
    memory (not in `total`); `activations` is then one micro-batch of the largest chunk, the one
    whose forward or backward runs."""

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.gradients
            + self.gradient_buffers
            + self.master
            + self.optimizer
            + self.activations
            + self.pipeline_blocks
            + self.expert_buffers
        )

    def row(self) -> list[str]:
        gib = [
            v / GIB
            for v in (
                self.weights,
                self.gradients,
                self.gradient_buffers,
                self.master,
                self.optimizer,
                self.activations,
                self.pipeline_blocks,
                self.expert_buffers,
                self.total,
            )
        ]
        return [
            f"pp{self.pp_rank}",
            f"{self.parameters / 1e9:.2f}B",
            *(f"{g:,.1f}" for g in gib),
            "+".join(map(str, self.in_flight)),
            f"{self.host_activations / GIB:,.1f}",
        ]


MEMORY_HEADER = [
    "pp rank",
    "params",
    "weights",
    "grads",
    "grad buckets",
    "fp32 master",
    "optimizer",
    "activations",
    "AttnRes cache",
    "EP buffers",
    "total GiB",
    "in flight",
    "host (offloaded)",
]


def optimizer_state_elements(job: RankJob) -> float:
    """Optimizer state elements this rank keeps: Muon one momentum, AdamW two moments; ZeRO-1
    keeps only the parameters this rank owns (the built optimizer's ownership)."""
    owned = set(job.optimizer.owned_parameter_names()) if job.config.parallel.zero1 else None
    total = 0
    for route in route_parameters(job.model, job.config.optimizer):
        if owned is not None and route.name not in owned:
            continue
        total += route.param.numel() * (1 if route.route == "muon" else 2)
    return total


def gradient_bytes(job: RankJob) -> tuple[float, float]:
    """(gradients, gradient buffers) of the built rank: with bf16 weights the reducer's
    persistent buffers are the gradients (`MainGradReducer.buffer_bytes`) and only the sharded
    segments come on top; with fp32 weights `p.grad` in the parameter's dtype and every bucket's
    flat buffer (launched during backward, freed when the reduction finishes) on top."""
    reducer = job.reducer
    segments = sum(
        bucket.segment * torch.empty((), dtype=bucket.dtype).element_size()
        for bucket in reducer.buckets
        if bucket.sharded
    )
    if isinstance(reducer, MainGradReducer):
        return float(reducer.buffer_bytes), float(segments)
    grads = sum(p.numel() * p.element_size() for p in job.model.parameters() if p.requires_grad)
    return float(grads), float(sum(bucket.nbytes for bucket in reducer.buckets) + segments)


def master_weight_bytes(job: RankJob) -> float:
    masters = job.optimizer.master_weights
    return float(sum(m.numel() * m.element_size() for m in masters.masters)) if masters is not None else 0.0


def expert_layer_buffer_bytes(ep, cfg: ModelConfig, tokens: int, element_bytes: int) -> float:
    """One MoE layer's dispatch and combine buffers for one micro-batch of `tokens` on this rank
    (`ExpertParallel.buffer_shapes`), and the experts' saved tensors of a fixed-shape receive
    buffer's padding rows: the whole buffer goes through the experts, so its rows beyond the s·k
    slots the routed term counts save their latent input and SiTU-GLU's five `[rows, I]` tensors
    too (`splits` receives exactly the rows that exist; `exact` sends them into a fixed buffer), and
    the top-up replica matrices a micro-batch fetched."""
    top_k = cfg.num_experts_per_token
    shapes = ep.buffer_shapes(tokens, top_k, cfg.expert_width, cfg.moe_intermediate_size)
    buffers = math.prod(shapes["dispatch"]) + math.prod(shapes["combine"])
    padding_rows = 0
    if ep.mode == "balanced" and ep.transport in ("relay", "spread", "padded", "exact", "nodes"):
        padding_rows = max(0, shapes["received"][0] - tokens * top_k)
    # `step` replicas' top-up slots (`ep_top_up_replicas`): their fetched `[T, F]` matrices, kept
    # for this micro-batch's backward (zeros where nothing was topped up: the shape is fixed)
    top_ups = math.prod(shapes["top_up_weights"][1:]) if "top_up_weights" in shapes else 0
    return (buffers + top_ups + padding_rows * (cfg.expert_width + 5 * cfg.moe_intermediate_size)) * element_bytes


def expert_buffer_bytes(job: RankJob, shape: ActivationShape, moe_layers: int) -> float:
    """Per MoE layer and micro-batch in flight, `expert_layer_buffer_bytes` over the layers."""
    ep = job.expert_parallel
    if ep is None or not moe_layers:
        return 0.0
    return expert_layer_buffer_bytes(ep, job.config.model, int(shape.outside_tokens), shape.element_bytes) * moe_layers


def replica_weight_bytes(job: RankJob, moe_layers: int) -> float:
    """`balanced` mode: the replica weights a rank holds, in the weights' dtype. `step` planning:
    fetched once per step and layer (`max_replicas` expert matrices) and kept with their
    gradients for the whole step. `online` planning: per MoE layer, the `[R, M, F]` exchange
    buffer of the one layer fetching now and the `[M, F]` replicas each layer keeps for its
    backward (gradients go home through the exchange's adjoint, into the home experts' gradients)."""
    ep = job.expert_parallel
    if ep is None or not moe_layers or not ep.max_replicas:
        return 0.0
    cfg = job.config.model
    shapes = ep.buffer_shapes(1, cfg.num_experts_per_token, cfg.expert_width, cfg.moe_intermediate_size)
    element = next(job.model.parameters()).element_size()
    if len(shapes["replica_weights"]) == 3:
        ranks, slots, width = shapes["replica_weights"]
        return (ranks * slots * width + slots * width * moe_layers) * element
    slots, width = shapes["replica_weights"]
    return 2 * slots * width * element * moe_layers


def rank_memory(job: RankJob, layout: Layout, micro_batches: int, kernel: AttentionKernel = "flash") -> RankMemory:
    """Every term for the pipeline rank `job` was built for (a `build_planning_rank` job)."""
    config: JobConfig = job.config
    cfg = config.model
    pp_rank = job.parallel.pp_rank
    element = 2 if config.train.precision != "fp32" else 4  # bf16, and fp8 (bf16 between its FP8 GEMMs)
    # Under context parallelism a rank holds seq_length / cp tokens of every micro-batch.
    shape = activation_shape(
        config,
        config.train.micro_batch_size * config.data.seq_length // layout.cp,
        layout.tp,
        bool(config.parallel.sequence_parallel and layout.tp > 1),
        layout.ep,
    )
    parameters = sum(p.numel() for p in job.model.parameters())
    in_flight = peak_in_flight(job.plan, pp_rank, micro_batches)
    activations, moe_in_flight, layer_ranges = 0.0, 0, job.plan.layer_ranges(pp_rank)
    for live, layer_range in zip(in_flight, layer_ranges):
        activations += live * chunk_activation_bytes(cfg, layer_range, shape, config.data.seq_length, kernel)
        moe_in_flight += live * sum(cfg.is_moe_layer(i) for i in range(*layer_range))
        activations += live * context_extra_activation_bytes(  # MLA's gathered keys under cp
            cfg,
            list(range(*layer_range)),
            cp=layout.cp,
            tp=layout.tp,
            micro_batch_size=config.train.micro_batch_size,
            seq_length=config.data.seq_length,
            element_bytes=element,
        )
    activations += sublayer_recompute_peak_bytes(cfg, range(*layer_ranges[0]), shape, config.data.seq_length, kernel)
    host = 0.0
    if config.train.offload_activations:
        host = activations
        activations = max(
            chunk_activation_bytes(cfg, layer_range, shape, config.data.seq_length, kernel)
            for layer_range in layer_ranges
        )
    blocks = 0.0
    if layout.pp > 1:
        block_bytes = shape.outside_tokens * cfg.hidden_size * element
        blocks = theoretical_peak_blocks(job.plan, pp_rank, micro_batches) * block_bytes
    gradients, gradient_buffers = gradient_bytes(job)
    return RankMemory(
        pp_rank,
        parameters,
        float(sum(p.numel() * p.element_size() for p in job.model.parameters())),
        gradients,
        gradient_buffers,
        master_weight_bytes(job),
        optimizer_state_elements(job) * 4.0,
        activations,
        blocks,
        expert_buffer_bytes(job, shape, 1) * moe_in_flight
        + replica_weight_bytes(job, sum(cfg.is_moe_layer(i) for r in layer_ranges for i in range(*r))),
        tuple(in_flight),
        host,
    )


__all__ = [
    "ActivationShape",
    "SavedElementBytes",
    "TORCH_PATH_BF16",
    "activation_shape",
    "RankMemory",
    "MEMORY_HEADER",
    "rank_memory",
    "chunk_activation_bytes",
    "layer_activation_bytes",
    "peak_in_flight",
    "optimizer_state_elements",
    "GIB",
]
