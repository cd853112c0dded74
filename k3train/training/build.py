"""What one rank runs, built in one place: the job, the planner and the tests call these.

    job = build_rank(config, parallel, device)          # pretrain_k3.py: model, reducer, optimizer, schedule
    job = build_planning_rank(config, layout, rank)     # the same objects on the meta device, no process groups
    model = build_model(config.model, plan, parallel)   # only this rank's model (planner, tests)

The model is this rank's pipeline chunks (one `K3ModelChunk` slice per virtual stage, with its TP
shards and EP experts) owned by one `K3RankModel`, initialised from the seed alone, so the weights
are the same under any layout. A planning build has the groups' ranks and sizes but no process
groups (`planning_parallel_state`): shapes, names, bucket packing and ZeRO-1 ownership are exact,
and no collective may run on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from k3train.config import JobConfig
from k3train.config.recipe import ConfigError
from k3train.kernels import te as te_kernels
from k3train.model.config import ModelConfig
from k3train.model.k3 import K3ModelChunk, K3RankModel
from k3train.optim.builder import build_optimizer, parameter_costs
from k3train.optim.muon import PerHeadMuon
from k3train.parallel.comm import Group
from k3train.parallel.config import ParallelConfig
from k3train.parallel.expert import ExpertParallel
from k3train.parallel.grad_reduce import DEFAULT_BUCKET_BYTES, GradientReducer
from k3train.parallel.mixed_precision import MainGradReducer
from k3train.parallel.muon_split import install_muon_split
from k3train.parallel.pipeline import PipelineExecutor, PipelinePlan, residual_shape
from k3train.parallel.state import Layout, ParallelState
from k3train.parallel.zero1 import DistributedOptimizer
from k3train.training.compile import compile_elementwise
from k3train.training.loop import precision_context
from k3train.training.offload import HostOffload, with_offload

META = torch.device("meta")


@dataclass
class RankJob:
    """Everything one rank trains with, built by `build_rank` (or `build_planning_rank`)."""

    config: JobConfig
    parallel: ParallelState
    device: torch.device
    plan: PipelinePlan  # the pipeline partition (the same on every rank)
    expert_parallel: ExpertParallel | None  # None when ep = 1 (experts replicated)
    model: K3RankModel  # this rank's chunks under the whole model's parameter names
    reducer: GradientReducer
    optimizer: DistributedOptimizer
    schedule: PipelineExecutor
    offload: HostOffload | None = None  # train.offload_activations: the hooks and the bytes they moved


class _PlanningState(ParallelState):
    """A `ParallelState` with the groups' ranks and sizes but no process groups (no collective
    may run on it): what the model, the reducer and the optimizer need to lay themselves out."""

    def _own_group(self, name: str, all_groups: list[list[int]], distributed: bool) -> Group:
        return super()._own_group(name, all_groups, False)


def planning_parallel_state(
    layout: Layout,
    rank: int,
    sequence_parallel: bool = False,
    tp_overlap_chunks: int = ParallelConfig.tp_overlap_chunks,
) -> ParallelState:
    """The parallel state global rank `rank` of `layout` would have, without torch.distributed."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside a world of {layout.world_size}")
    return _PlanningState(layout, rank, sequence_parallel=sequence_parallel, tp_overlap_chunks=tp_overlap_chunks)


def fp8_excluded_layers(model_config: ModelConfig, excluded: Sequence[int] | None) -> list[int]:
    """The decoder layers kept out of FP8: `train.fp8_excluded_layers`, or the first and the last."""
    if excluded is None:
        return sorted({0, model_config.num_hidden_layers - 1})
    return sorted(set(excluded))


def build_model(
    model_config: ModelConfig,
    plan: PipelinePlan,
    parallel: ParallelState,
    expert_parallel: ExpertParallel | None = None,
    *,
    seed: int | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    fp8_recipe: str = "delayed",
    fp8_excluded: Sequence[int] | None = None,
) -> K3RankModel:
    """This rank's model: one `K3ModelChunk` slice per virtual stage (`model.chunks`, in virtual-stage
    order), initialised from `seed` (0 when not given), in `dtype`, on `device`. On the meta device
    nothing is allocated or initialised. `model.linear_backend` is resolved for `device`
    (`kernels.te.resolve_linear_backend`); with Transformer Engine the layers `fp8_excluded`
    (`fp8_excluded_layers`) keep their projections out of FP8."""
    target = torch.device(device) if device is not None else torch.device("cpu")
    on_meta = target.type == "meta"
    backend = te_kernels.resolve_linear_backend(model_config.linear_backend, target)
    linear_factory = te_kernels.linear_factory_for(backend, target, fp8_recipe)
    chunks = []
    for layer_range in plan.layer_ranges(parallel.pp_rank):
        if on_meta:
            with torch.device(META):
                chunk = K3ModelChunk(
                    model_config, layer_range=layer_range, parallel=parallel, expert_parallel=expert_parallel
                )
        else:
            # Initialised once, in the constructor (a second draw would double the start-up time).
            chunk = K3ModelChunk(
                model_config,
                layer_range=layer_range,
                parallel=parallel,
                expert_parallel=expert_parallel,
                seed=seed if seed is not None else 0,
                linear_factory=linear_factory,
            )
            if device is not None:
                chunk = chunk.to(device)
        if dtype is not None:
            chunk = chunk.to(dtype)
        if backend == "te":
            te_kernels.keep_modules_out_of_fp8(
                [
                    chunk.layers[str(i)]
                    for i in fp8_excluded_layers(model_config, fp8_excluded)
                    if str(i) in chunk.layers
                ]
            )
        chunks.append(chunk)
    return K3RankModel(chunks)


def check_precision_support(config: JobConfig, device: torch.device) -> None:
    """Start-up check of `train.precision` and `model.linear_backend` on `device`: raises
    ConfigError with one line naming what is missing and how to get it. The meta device
    (planning) needs nothing."""
    device = torch.device(device)
    if device.type == "meta":
        return
    train, model = config.train, config.model
    if train.precision == "fp8" or model.linear_backend == "te":
        field = "train.precision=fp8" if train.precision == "fp8" else "model.linear_backend=te"
        missing = te_kernels.te_missing(device)
        if missing is not None:
            raise ConfigError(f"{field} {missing}; or use train.precision=bf16 with model.linear_backend=torch")
    if train.precision != "fp8":
        return
    if model.linear_backend == "torch":
        raise ConfigError(
            "train.precision=fp8 runs its GEMMs in Transformer Engine: set model.linear_backend=te "
            "(or auto), or use train.precision=bf16"
        )
    # model.recompute=sublayer recomputes through Transformer Engine's checkpoint, inside the FP8
    # region (kernels/te.py, fp8_checkpoint): every recompute mode runs under fp8.
    if train.fp8_recipe == "blockwise":
        te, _ = te_kernels.import_transformer_engine()
        unsupported = te_kernels.blockwise_unsupported(te) if te is not None else "Transformer Engine missing"
        if unsupported is not None:
            raise ConfigError(
                f"train.fp8_recipe=blockwise (Float8BlockScaling) cannot run here: {unsupported}; "
                f"use fp8_recipe=delayed or current"
            )
    if train.fp8_recipe == "mxfp8" and torch.cuda.get_device_capability(device)[0] < 10:
        raise ConfigError(
            f"train.fp8_recipe=mxfp8 needs a GPU of compute capability 10.0 or later (Blackwell), "
            f"this one is {torch.cuda.get_device_capability(device)}: use fp8_recipe=delayed or current"
        )


def forward_precision_context(
    config: JobConfig, device: torch.device, parallel: ParallelState | None = None
) -> Callable[[], contextlib.AbstractContextManager]:
    """The context of every forward pass: `training.loop.precision_context` (bf16 autocast for
    bf16 and fp8), and for fp8 Transformer Engine's FP8 region with the recipe of the config.
    The delayed recipe's amaxes are reduced over the stage's data × tensor ranks, so every rank
    of a stage holds the same FP8 state (a checkpoint stores it once)."""
    precision = config.train.precision
    base = precision_context("bf16" if precision == "fp8" else precision, device)
    if precision != "fp8" or torch.device(device).type == "meta":
        return base
    te, why = te_kernels.import_transformer_engine()
    if te is None:
        raise ConfigError(f"train.precision=fp8 needs Transformer Engine ({why}); {te_kernels.INSTALL_HINT}")
    recipe = te_kernels.make_fp8_recipe(
        te, config.train.fp8_recipe, config.train.fp8_amax_history_len, config.train.fp8_amax_compute_algo
    )
    group = parallel.data_tensor if parallel is not None else None
    amax_group = group.process_group if group is not None and group.size > 1 else None
    fp8 = te_kernels.fp8_forward_context(te, recipe, amax_group)

    @contextlib.contextmanager
    def bf16_and_fp8():
        with base(), fp8():
            yield

    return bf16_and_fp8


def model_weight_dtype(config: JobConfig) -> torch.dtype | None:
    """The dtype the model's weights are cast to under sharded fp32 masters (None: fp32 weights
    stepped in place)."""
    return torch.bfloat16 if config.train.weights == "bf16_with_fp32_master_shards" else None


def gradient_dtype(config: JobConfig) -> torch.dtype:
    """`train.grad_dtype` as a torch dtype: what gradients accumulate and are reduced in."""
    return torch.bfloat16 if config.train.grad_dtype == "bf16" else torch.float32


def _build_optimizer(
    model: K3RankModel, config: JobConfig, parallel: ParallelState, bucket_bytes: int
) -> DistributedOptimizer:
    """Per-Head Muon + AdamW over `model`, its state sharded over DP (ZeRO-1) when asked; the
    one place the job's optimizer is made: built here and handed, with each parameter's cost (which
    balances the ZeRO-1 owners), to the data-parallel wrapper."""
    optimizer = DistributedOptimizer(
        build_optimizer(model, config.optimizer),
        model,
        parallel,
        parameter_costs(model, config.optimizer),
        zero1=config.parallel.zero1,
        bucket_bytes=bucket_bytes,
        model_dtype=model_weight_dtype(config),
    )
    if not config.parallel.zero1 and config.optimizer.muon_split_over_dp and optimizer.master_weights is None:
        # Each DP rank orthogonalises the matrices ZeRO-1 would give it; updates all-gathered.
        install_muon_split(optimizer.optimizer, model.named_parameters(), optimizer.plan.owners, parallel, bucket_bytes)
    return optimizer


def agreed_cpu_bf16_min_flops(group: Group) -> float:
    """Where "auto" Newton–Schulz switches to bf16 on this CPU (k3train/optim/bf16_probe.py), as
    the first rank of `group` measured it (or read it from the cache), the same on every rank of
    the group: the ranks of a stage (data and tensor parallel) that orthogonalise the same
    matrix must do it in the same dtype. A start-up exchange of one number, not counted traffic."""
    from k3train.optim.bf16_probe import cpu_bf16_min_flops

    crossover = torch.tensor([cpu_bf16_min_flops() if group.rank == 0 else 0.0], dtype=torch.float64)
    if group.size > 1:
        torch.distributed.broadcast(crossover, src=group.ranks[0], group=group.process_group)
    return float(crossover.item())


def build_rank(
    config: JobConfig,
    parallel: ParallelState,
    device: torch.device,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    overlap: bool = True,
    dtype: torch.dtype | None = None,
) -> RankJob:
    """The job of this rank: plan, experts, model (from `config.train.seed`), gradient reducer,
    optimizer and pipeline schedule. Raises `ConfigError` (`PipelineConfigError` among them: a
    layout the plan, the experts or the model cannot run) before anything communicates."""
    check_precision_support(config, device)
    try:
        plan = PipelinePlan.from_config(config.model, config.parallel)
        expert_parallel = ExpertParallel.from_state(parallel, config.parallel, config.model.num_experts)
        model = build_model(
            config.model,
            plan,
            parallel,
            expert_parallel,
            seed=config.train.seed,
            device=device,
            dtype=dtype,
            fp8_recipe=config.train.fp8_recipe,
            fp8_excluded=config.train.fp8_excluded_layers,
        )
    except ConfigError:
        raise
    except ValueError as error:  # the layers' own shape checks: the message names the sizes
        raise ConfigError(str(error)) from error
    if config.train.compile and device.type != "meta":
        compile_elementwise(model, config.train.compile_regions)  # in place: parameters, names and hooks unchanged
    optimizer = _build_optimizer(model, config, parallel, bucket_bytes)
    if device.type == "cpu" and isinstance(optimizer.optimizer, PerHeadMuon):
        optimizer.optimizer.ns_cpu_bf16_min_flops = agreed_cpu_bf16_min_flops(parallel.data_tensor)
    # Under ZeRO-1 the gradients are reduce-scattered to their owners (the optimizer's plan).
    reducer: GradientReducer
    if optimizer.master_weights is not None:  # bf16 weights: gradients accumulate in the buffers
        reducer = MainGradReducer(
            model,
            parallel,
            gradient_dtype(config),
            bucket_bytes=bucket_bytes,
            overlap=overlap,
            owners=optimizer.gradient_owners(),
        )
        optimizer.take_gradients_from(reducer)
    else:
        reducer = GradientReducer(
            model,
            parallel,
            bucket_bytes=bucket_bytes,
            reduce_dtype=torch.bfloat16 if config.train.grad_dtype == "bf16" else None,
            overlap=overlap,
            owners=optimizer.gradient_owners(),
        )
    offload = HostOffload() if config.train.offload_activations and device.type != "meta" else None
    schedule = PipelineExecutor(
        plan,
        parallel.pp,
        residual_shape(
            config.train.micro_batch_size,
            config.data.seq_length // parallel.layout.cp,
            config.model.hidden_size,
            parallel.tp.size,
            parallel.sequence_parallel,
        ),
        # Stage outputs travel in the model's dtype: bf16 weights make a bf16 residual stream.
        dtype=model_weight_dtype(config) or torch.float32,
        device=device,
        forward_context=with_offload(forward_precision_context(config, device, parallel), offload),
        # The pipeline's last backward of each chunk turns on gradient reduction (DP overlap) and
        # returns the `step` expert replicas' gradients home, before the reduction reads them.
        before_backward=lambda virtual_stage, last: _last_micro_batch(last, reducer, expert_parallel),
        grad_group=parallel.pp_grad,  # backward messages on their own communicator (NCCL order)
        document_starts_shape=(
            (config.train.micro_batch_size, config.data.seq_length)
            if config.data.document_boundaries == "reset"
            else None
        ),
    )
    return RankJob(config, parallel, device, plan, expert_parallel, model, reducer, optimizer, schedule, offload)


def _last_micro_batch(last: bool, reducer: GradientReducer, expert_parallel: ExpertParallel | None) -> None:
    reducer.set_last_micro_batch(last)
    if expert_parallel is not None:
        expert_parallel.set_last_micro_batch(last)


def build_planning_rank(
    config: JobConfig,
    layout: Layout,
    rank: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> RankJob:
    """`build_rank` for global rank `rank` of `layout` on the meta device, without process groups
    (for the planner and the traffic formula: exact shapes, buckets and ownership, no memory)."""
    parallel = planning_parallel_state(
        layout, rank, config.parallel.sequence_parallel, config.parallel.tp_overlap_chunks
    )
    return build_rank(config, parallel, META, bucket_bytes=bucket_bytes, overlap=False, dtype=dtype)


__all__ = [
    "RankJob",
    "build_rank",
    "build_planning_rank",
    "build_model",
    "check_precision_support",
    "forward_precision_context",
    "gradient_dtype",
    "model_weight_dtype",
    "fp8_excluded_layers",
    "planning_parallel_state",
]
