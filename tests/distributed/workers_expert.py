"""Worker side of the expert-parallel checks (run through harness.run_workers).

`run_checks` runs a list of checks in one launch (imports cost seconds per process):

* `equivalence`: an EP model (built as the single-process model, then `use_expert_parallel` on
  every MoE layer) against the single-process model on the whole global batch, float64: loss,
  every gradient (an expert's gradient on its home rank against the reference's slice), and the
  routing bias the balancer computes for the next step over `routing_statistics_group(state)`.
  The gate bias is skewed towards the first rank's home experts, so `balanced` mode has to
  replicate. With a capacity that drops, the reference model applies `reference_capacity_keep`
  (plain Python) per source rank: the EP model must reproduce that model and drop exactly the
  slots it predicts.
* `static_shapes`: one MoE layer, forward and backward under `StaticShapeGuard` (fails on any
  device-to-host read or data-dependent shape), for very different routings; the op traces
  (every op's output shapes) must be identical and the exchanged buffers have the shapes
  `ExpertParallel.buffer_shapes` derives from the config.

The checks of the dispatcher alone (per-source skew, concentrated routing, the `nodes`
transport, the TE stand-in) live in `workers_expert_dispatcher.py`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import cast

import torch
import torch.distributed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from k3train.model.decoder import DecoderLayer
from k3train.model.k3 import K3ModelChunk
from k3train.model.moe import GroupedExperts, LatentMoE, finish_expert_step
from k3train.parallel.config import ModelSplitSizes
from k3train.parallel.expert import ExpertParallel, ExpertParameter, routing_statistics_group
from k3train.parallel.grad_reduce import GradientReducer
from k3train.parallel.state import ParallelState, resolve_layout
from k3train.parallel.tensor import ShardedParameter, TensorParallel
from tests.distributed.workers_expert_dispatcher import (
    concentrated_routing,
    node_dedup,
    skewed_sources,
    small_config,
)


# ---------------------------------------------------------------------------- a whole layer, then EP
@torch.no_grad()
def use_expert_parallel(moe: LatentMoE, expert_parallel: ExpertParallel) -> None:
    """Switch a layer built with all experts to expert parallelism: keep only this rank's home
    experts (slices of the current stacks, so a model initialised or loaded whole keeps its
    values) and route through `expert_parallel`."""
    full = moe.experts
    offset, count = expert_parallel.expert_offset, expert_parallel.num_local_experts
    local = GroupedExperts(moe.config, count).to(device=full.w1.device, dtype=full.w1.dtype)
    for name in ("w1", "w3", "w2"):
        getattr(local, name).copy_(getattr(full, name)[offset : offset + count])
    expert_parallel.mark_expert_params(local)
    moe.experts = local
    moe.expert_parallel = expert_parallel


# ---------------------------------------------------------------------------- drop policy reference
def reference_capacity_keep(
    expert_ids: torch.Tensor, weights: torch.Tensor, ep: int, local_experts: int, capacity: int
) -> torch.Tensor:
    """The `capacity` drop policy in plain Python, for one source rank: per destination rank keep
    the `capacity` slots with the highest routing weight (ties: lower slot index), drop the rest."""
    tokens, top_k = expert_ids.shape
    ids, w = expert_ids.tolist(), weights.tolist()
    per_dest: dict[int, list[tuple[float, int]]] = {}
    for t in range(tokens):
        for j in range(top_k):
            per_dest.setdefault(ids[t][j] // local_experts, []).append((-w[t][j], t * top_k + j))
    keep = torch.zeros(tokens * top_k, dtype=torch.bool)
    for slots in per_dest.values():
        for _, slot in sorted(slots)[:capacity]:
            keep[slot] = True
    return keep.view(tokens, top_k)


def source_token_indices(batch: int, seq: int, dp: int, tp: int, sequence_parallel: bool) -> list[list[int]]:
    """For every source rank (global rank order, TP fastest), the indices of its tokens in the
    reference's flattened `[batch, seq]`, in the order that rank flattens them."""
    rows = batch // dp
    chunk = seq // tp if sequence_parallel else seq
    sources = []
    for d in range(dp):
        for t in range(tp):
            if not sequence_parallel and t > 0:
                continue
            start = t * chunk if sequence_parallel else 0
            sources.append([(d * rows + i) * seq + start + j for i in range(rows) for j in range(chunk)])
    return sources


def install_reference_drops(reference: K3ModelChunk, sources: list[list[int]], ep: int, capacity: int) -> list:
    """Make the reference's experts drop, per source, what `reference_capacity_keep` says (as a
    zero routing weight). Returns a list that collects `(layer, keep [tokens, k])` per forward."""
    record = []
    local_experts = reference.config.num_experts // ep
    for layer_name, module in reference.layers.items():
        layer = cast(DecoderLayer, module)  # the ModuleDict holds DecoderLayers only
        if not layer.is_moe:
            continue
        experts = layer.block_sparse_moe.experts
        original = experts.forward

        def forward(latent, expert_ids, weights, _original=original, _layer=layer_name):
            keep = torch.zeros(expert_ids.shape, dtype=torch.bool)
            for indices in sources:
                index = torch.tensor(indices)
                keep[index] = reference_capacity_keep(
                    expert_ids[index], weights[index].detach(), ep, local_experts, capacity
                )
            record.append((_layer, keep))
            return _original(latent, expert_ids, weights * keep)

        experts.forward = forward  # type: ignore[method-assign]  # the test patches this instance's forward on purpose
    return record


# ---------------------------------------------------------------------------- equivalence
def skew_gate_bias(model: K3ModelChunk, num_skewed: int, skew: float) -> None:
    for moe in model.moe_layers():
        bias = torch.zeros(model.config.num_experts)
        bias[:num_skewed] = skew
        moe.gate.e_score_correction_bias.copy_(bias)


def forget_warm_up_step(models: list, state: ParallelState) -> None:
    """End a warm-up step without an optimizer step: its loads plan the replicas of the next
    step (`finish_expert_step`); gradients, routing statistics and balancer observations go."""
    moes = [moe for model in models for moe in model.moe_layers()]
    finish_expert_step(moes, state)
    for model in models:
        model.zero_grad(set_to_none=True)
        model.discard_routing_statistics()
    for moe in moes:
        moe.pop_step_stats()


def reduce_gradients(models: list, state: ParallelState) -> str:
    """parallel/grad_reduce.py's GradientReducer: expert grads SUM over expert_dp, TP-partial ones over
    data_tensor, the rest over dp, all divided by dp."""
    GradientReducer(nn.ModuleList(models), state, overlap=False).finish()
    return "GradientReducer"


def reference_view(full: torch.Tensor, param: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if getattr(param, "expert_parallel", False):
        return full.narrow(0, cast(ExpertParameter, param).expert_offset, param.shape[0])
    if getattr(param, "tensor_parallel", False):
        return full.chunk(state.tp.size, dim=cast(ShardedParameter, param).partition_dim)[state.tp.rank]
    return full


def compare_gradients(models: list, reference: K3ModelChunk, state: ParallelState) -> dict:
    reference_params = dict(reference.named_parameters())
    worst, worst_name, checked, worst_expert, experts = 0.0, "", 0, 0.0, 0
    for model in models:
        for name, param in model.named_parameters():
            reference_grad = reference_params[name].grad
            if reference_grad is None:
                assert param.grad is None or torch.all(param.grad == 0), name
                continue
            expected = reference_view(reference_grad, param, state)
            assert param.grad is not None, f"{name}: no gradient"
            assert param.grad.shape == expected.shape, (name, param.grad.shape, expected.shape)
            error = (param.grad - expected).abs().max().item()
            checked += 1
            if getattr(param, "expert_parallel", False):
                experts += 1
                worst_expert = max(worst_expert, error)
            if error > worst:
                worst, worst_name = error, name
    return {
        "max_grad_error": worst,
        "max_expert_grad_error": worst_expert,
        "worst_param": worst_name,
        "checked": checked,
        "expert_params_checked": experts,
    }


def dispatch_facts(models: list, reference_keeps, my_source) -> dict:
    """Per MoE layer of this rank: what its last dispatch did."""
    layers = {}
    for model in models:
        for layer_name, layer in model.layers.items():
            if not layer.is_moe:
                continue
            info = layer.block_sparse_moe.last_dispatch
            facts = {
                "dropped": int(info.dropped),
                "replicas": int(info.replicas),
                "capacity": info.capacity,
                "received": int(info.received),
            }
            if info.plan is not None:
                ep = info.plan.rank_load.shape[0]
                facts["rank_load"] = info.plan.rank_load.tolist()
                facts["load_before"] = info.plan.load.view(ep, -1).sum(1).tolist()
            if reference_keeps is not None:
                expected_keep = dict(reference_keeps)[layer_name][torch.tensor(my_source)]
                facts["keep_mismatches"] = int((expected_keep != info.keep).sum())
                facts["reference_dropped"] = int((~expected_keep).sum())
            layers[layer_name] = facts
    return layers


def routing_checks(models: list, reference: K3ModelChunk, state: ParallelState) -> dict:
    """Next step's bias (combined over every rank that routed distinct tokens) and the step's
    expert loads against the single-process model's."""
    moes = [moe for model in models for moe in model.moe_layers()]
    reference_layers = {name: cast(DecoderLayer, layer) for name, layer in reference.layers.items()}
    reference_moes = {name: layer.block_sparse_moe for name, layer in reference_layers.items() if layer.is_moe}
    mine = [name for model in models for name, layer in model.layers.items() if layer.is_moe]
    group = routing_statistics_group(state)
    stats = [moe.pop_step_stats(group) for moe in moes]
    reference.update_routing_biases()
    for model in models:
        model.update_routing_biases(group)
    bias_error = max(
        (moe.gate.e_score_correction_bias - reference_moes[name].gate.e_score_correction_bias).abs().max().item()
        for moe, name in zip(moes, mine)
    )
    load_matches = all(
        torch.equal(stat.expert_load, reference_moes[name].pop_step_stats().expert_load)
        for stat, name in zip(stats, mine)
    )
    return {
        "bias_error": bias_error,
        "load_matches": load_matches,
        "stats": [s.as_dict() for s in stats],
        "dispatch_calls": [s.micro_batches for s in stats],  # per layer: two per micro-batch with halves
    }


def setup(env, spec: dict):
    config = small_config(**spec.get("config", {}))
    tp, ep, sp = spec.get("tp", 1), spec["ep"], spec.get("sequence_parallel", False)
    layout = resolve_layout(env.world_size, tp, spec.get("pp", 1), 0, ep, 1, ModelSplitSizes.of(config))
    state = ParallelState(layout, env.rank, sequence_parallel=sp)
    expert_parallel = ExpertParallel(
        state.ep,
        config.num_experts,
        spec["mode"],
        spec["capacity_factor"],
        spec.get("max_replicas", 2),
        transport=spec.get("transport", "relay"),
        replica_planning=spec.get("replica_planning", "online"),
        top_up_replicas=spec.get("top_up", 0),
        overlap_chunks=spec.get("overlap_chunks", 0),
        overlap_halves=spec.get("overlap_halves", False),
    )
    reference = K3ModelChunk(config).double()
    reference.init_weights(seed=7)
    skew_gate_bias(reference, config.num_experts // ep, spec.get("skew", 0.0))
    return config, state, expert_parallel, reference


def equivalence(env, spec: dict) -> dict:
    """One step, no pipeline: the EP model on this rank's rows against the reference on all rows."""
    started = time.perf_counter()
    config, state, expert_parallel, reference = setup(env, spec)
    tp, ep, sp, dp = state.tp.size, state.ep.size, state.sequence_parallel, state.layout.dp
    model = K3ModelChunk(config, parallel=state).double()
    model.init_weights(seed=7)
    for moe in model.moe_layers():
        use_expert_parallel(moe, expert_parallel)
    skew_gate_bias(model, config.num_experts // ep, spec.get("skew", 0.0))

    batch, seq = spec.get("batch", 2 * dp), 32
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    rows = slice(state.dp_rank * batch // dp, (state.dp_rank + 1) * batch // dp)

    tokens_per_source = batch // dp * seq // (tp if sp else 1)
    capacity = expert_parallel.capacity(tokens_per_source, config.num_experts_per_token)
    reference_keeps, my_source = None, None
    if spec["mode"] == "capacity" and capacity < tokens_per_source * config.num_experts_per_token:
        sources = source_token_indices(batch, seq, dp, tp, sp)
        reference_keeps = install_reference_drops(reference, sources, ep, capacity)
        my_source = sources[state.dp_rank * (tp if sp else 1) + (state.tp_rank if sp else 0)]

    reference_loss = reference.loss(reference(inputs), labels)
    reference_loss.backward()
    if spec["mode"] == "balanced" and expert_parallel.replica_planning == "step":
        # step 0 places no replicas: plan them from a first step's loads
        model.loss(model(inputs[rows]), labels[rows]).backward()
        forget_warm_up_step([model], state)
    # `micro_batches`: the rank's rows in that many backwards (equal sizes: the mean of their
    # means is the rank's mean); `step` replicas accumulate until the last returns them home
    count = spec.get("micro_batches", 1)
    pieces = list(zip(inputs[rows].chunk(count), labels[rows].chunk(count)))
    loss = torch.zeros((), dtype=torch.float64)
    for index, (piece, piece_labels) in enumerate(pieces):
        expert_parallel.set_last_micro_batch(index == count - 1)
        piece_loss = model.loss(model(piece), piece_labels) / count
        piece_loss.backward()
        loss = loss + piece_loss.detach()
    reducer = reduce_gradients([model], state)
    finish_expert_step(model.moe_layers(), state)  # replica gradients into the home experts
    global_loss = state.dp.all_reduce(loss.detach().clone()) / dp
    result = {"loss": global_loss.item(), "reference_loss": reference_loss.item(), "reducer": reducer}
    result.update(compare_gradients([model], reference, state))
    result["layers"] = dispatch_facts([model], reference_keeps, my_source)
    result.update(routing_checks([model], reference, state))
    result.update(traffic=state.counter.snapshot(), seconds=time.perf_counter() - started)
    return result


def pipeline_equivalence(env, spec: dict) -> dict:
    """EP inside pipeline stages: `PipelineExecutor` over several micro-batches per DP rank."""
    from k3train.parallel.pipeline import PipelineExecutor, PipelinePlan, residual_shape
    from k3train.training.build import build_model

    started = time.perf_counter()
    config, state, expert_parallel, reference = setup(env, spec)
    plan = PipelinePlan.build(config.num_hidden_layers, state.layout.pp, 1, config.attn_res, config.attn_res_block_size)
    chunks = build_model(config, plan, state, seed=7, dtype=torch.float64).chunks
    for chunk in chunks:
        for moe in chunk.moe_layers():
            use_expert_parallel(moe, expert_parallel)
        skew_gate_bias(chunk, config.num_experts // state.ep.size, spec.get("skew", 0.0))

    micro_batch_size, seq, count, dp = 2, 16, spec.get("micro_batches", 2), state.layout.dp
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (count * dp * micro_batch_size, seq + 1), generator=generator)
    reference_loss = reference.loss(reference(tokens[:, :-1]), tokens[:, 1:])
    reference_loss.backward()
    micro_batches = list(tokens.split(micro_batch_size))[state.dp_rank * count : (state.dp_rank + 1) * count]
    shape = residual_shape(micro_batch_size, seq, config.hidden_size, state.tp.size, state.sequence_parallel)
    if spec["mode"] == "balanced" and expert_parallel.replica_planning == "step":
        # step 0 places no replicas: plan them from a first step's loads
        PipelineExecutor(plan, state.pp, shape, dtype=torch.float64).run(chunks, micro_batches)
        forget_warm_up_step(chunks, state)
    # as build.py: the schedule's last backward of a chunk returns the `step` replicas' gradients
    last = lambda virtual_stage, is_last: expert_parallel.set_last_micro_batch(is_last)  # noqa: E731
    loss = PipelineExecutor(plan, state.pp, shape, dtype=torch.float64, before_backward=last).run(chunks, micro_batches)
    reducer = reduce_gradients(chunks, state)
    finish_expert_step([moe for chunk in chunks for moe in chunk.moe_layers()], state)
    global_loss = state.dp.all_reduce(loss.clone()) / dp
    result = {
        "loss": global_loss.item(),
        "reference_loss": reference_loss.item(),
        "reducer": reducer,
        "pp_rank": state.pp_rank,
    }
    result.update(compare_gradients(chunks, reference, state))
    result["layers"] = dispatch_facts(chunks, None, None)
    result.update(routing_checks(chunks, reference, state))
    result.update(traffic=state.counter.snapshot(), seconds=time.perf_counter() - started)
    return result


# ---------------------------------------------------------------------------- static shapes
FORBIDDEN_OPS = (
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "bincount",
    "repeat_interleave",
    "masked_scatter",
    "histc",
)


class StaticShapeGuard(TorchDispatchMode):
    """Fails on every device-to-host read and every op whose output shape depends on tensor
    values; records `(op, output shapes)` of every op it sees (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.trace: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(forbidden in name for forbidden in FORBIDDEN_OPS):
            raise AssertionError(f"data-dependent op on the dispatch path: {name}")
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
            indices = args[1]
            if any(i is not None and i.dtype == torch.bool for i in indices):
                raise AssertionError(f"boolean-mask indexing (data-dependent shape) on the dispatch path: {name}")
        out = func(*args, **(kwargs or {}))
        shapes = tuple(
            tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)
        )
        self.trace.append((name, shapes))
        return out


@contextmanager
def no_host_reads():
    """`.item()`, `.tolist()`, `int()/float()/bool()` of a tensor, `.numpy()` raise inside."""
    names = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name}() reads a tensor on the host on the dispatch path")

        return method

    @contextmanager
    def allowed():  # the stand-in of a device-split exchange, which reads nothing on a GPU
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        try:
            yield
        finally:
            for name in names:
                setattr(torch.Tensor, name, refuse(name))

    for name in names:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield allowed
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def static_shapes(env, spec: dict) -> dict:
    """Forward + backward of one EP MoE layer under the guard for several routings."""
    config = small_config(balancer="quantile", **spec.get("config", {}))  # exact QB: no bincount in observe
    layout = resolve_layout(env.world_size, 1, 1, 0, env.world_size, 1, ModelSplitSizes.of(config))
    state = ParallelState(layout, env.rank)
    expert_parallel = ExpertParallel(
        state.ep,
        config.num_experts,
        spec["mode"],
        spec["capacity_factor"],
        spec.get("max_replicas", 2),
        compute="gather",
        transport=spec.get("transport", "relay"),
        replica_planning=spec.get("replica_planning", "online"),
        top_up_replicas=spec.get("top_up", 0),
    )
    moe = LatentMoE(config, TensorParallel.single(), expert_parallel=expert_parallel).double()
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)
    exchanged: list[tuple[str, tuple]] = []
    group = state.ep
    original_all_to_all, original_all_gather = group.all_to_all, group.all_gather
    original_async = group.all_to_all_async

    def all_to_all(tensor):
        exchanged.append(("all_to_all", tuple(tensor.shape)))
        return original_all_to_all(tensor)

    def all_to_all_async(tensor, output, send=None, receive=None, label=None):  # the transports' hops
        exchanged.append(("all_to_all", tuple(tensor.shape)))
        return original_async(tensor, output, send, receive, label)

    def all_gather(tensor, dim=0):
        exchanged.append(("all_gather", tuple(tensor.shape)))
        return original_all_gather(tensor, dim)

    group.all_to_all, group.all_gather = all_to_all, all_gather  # type: ignore[method-assign]  # counting wrappers patched on this instance
    group.all_to_all_async = all_to_all_async  # type: ignore[method-assign]
    # `exact`: on gloo its counts are read on the host (free there; NVSHMEM's device-split
    # all-to-all reads nothing on a GPU). Its fixed buffers are recorded, its host read let through.
    counted = expert_parallel.counted_replicas  # the transport's, which also fetches the replicas
    host_reads: dict = {}  # the guard's `allowed`, set inside it
    if counted is not None:
        original_counted = counted.launch

        def counted_launch(tensor, output, send_counts, receive_counts, label=None):
            exchanged.append(("counted_all_to_all", (tuple(tensor.shape), tuple(output.shape))))
            group.all_to_all_async = original_async  # its prefixes vary
            try:
                with _disable_current_modes(), host_reads["allowed"]():
                    return original_counted(tensor, output, send_counts, receive_counts, label)
            finally:
                group.all_to_all_async = all_to_all_async

        counted.launch = counted_launch
    batch, seq = 2, 16
    x = torch.randn(batch, seq, config.hidden_size, generator=generator, dtype=torch.float64)
    experts = config.num_experts
    routings = {
        "uniform": torch.zeros(experts),
        "skewed": torch.linspace(1.0, 0.0, experts),  # hot experts on rank 0
        "one_rank": torch.where(torch.arange(experts) < experts // env.world_size, 5.0, 0.0),
        "last_rank": torch.where(torch.arange(experts) >= experts - experts // env.world_size, 5.0, 0.0),
    }
    traces, exchanges, facts = {}, {}, {}
    for name, bias in routings.items():
        moe.gate.e_score_correction_bias.copy_(bias)
        # the step boundary (replicas planned from the previous routing's loads) and the step's
        # replica fetch happen outside the dispatch path, so outside the guard
        expert_parallel.finish_step()
        moe.zero_grad()
        if spec["mode"] == "balanced" and expert_parallel.replica_planning == "step":
            expert_parallel.step_replicas(moe.experts)
        exchanged.clear()
        guard = StaticShapeGuard()
        # `step` replicas: a micro-batch before the step's last (the last one's backward also
        # returns the replicas' gradients with the step's exact splits; `finish_step` does it here)
        expert_parallel.set_last_micro_batch(expert_parallel.replica_planning != "step")
        with no_host_reads() as allowed, guard:
            host_reads["allowed"] = allowed
            out = moe(x)
            out.square().sum().backward()
        expert_parallel.set_last_micro_batch(True)
        traces[name] = guard.trace
        exchanges[name] = list(exchanged)
        info = moe.last_dispatch
        assert info is not None  # set by the expert-parallel forward above
        facts[name] = {"dropped": int(info.dropped), "replicas": int(info.replicas), "received": int(info.received)}
    group.all_to_all, group.all_gather = original_all_to_all, original_all_gather  # type: ignore[method-assign]  # restores the originals
    group.all_to_all_async = original_async  # type: ignore[method-assign]
    if counted is not None:
        counted.launch = original_counted
    names = list(traces)
    identical = all(traces[n] == traces[names[0]] for n in names) and all(
        exchanges[n] == exchanges[names[0]] for n in names
    )
    expected = expert_parallel.buffer_shapes(
        batch * seq, config.num_experts_per_token, config.expert_width, config.moe_intermediate_size
    )
    return {
        "identical": identical,
        "ops": len(traces[names[0]]),
        "exchanges": exchanges[names[0]],
        "expected_shapes": expected,
        "facts": facts,
        "first_difference": _first_difference(traces[names[0]], traces[names[-1]]),
    }


def _first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    return None if len(a) == len(b) else (min(len(a), len(b)), "length", (len(a), len(b)))


# ---------------------------------------------------------------------------- entry point
CHECKS = {
    "equivalence": equivalence,
    "pipeline": pipeline_equivalence,
    "static_shapes": static_shapes,
    "skewed_sources": skewed_sources,
    "concentrated_routing": concentrated_routing,
    "node_dedup": node_dedup,
}


def run_checks(env, payload: list[dict]) -> list[dict]:
    """Run each `{"check": name, ...}` in order on every rank; return the per-check results."""
    return [CHECKS[spec["check"]](env, spec) for spec in payload]
