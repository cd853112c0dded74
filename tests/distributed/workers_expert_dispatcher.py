"""Worker side of the expert-parallel checks of the dispatcher alone (run through
harness.run_workers, from `workers_expert.run_checks`): a rank's home experts against the
single-process experts on the same tokens, outputs and gradients.

* `skewed_sources`: each source routes its own hot experts (per-source skew), over three steps;
* `concentrated_routing`: every token of every rank picks the same top-k experts from the first
  micro-batch, then all switch to another rank's;
* `node_dedup`: the `nodes` transport on ranks taken as nodes, counting the inter-node bytes.

With `linear_backend: te` the experts' GEMMs run through `kernels/te.py` on the CPU stand-in of
Transformer Engine (`fp8`: inside its FP8 region).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, cast

import torch
import torch.distributed

from k3train.model.config import ModelConfig
from k3train.model.moe import GroupedExperts
from k3train.parallel.config import ModelSplitSizes
from k3train.parallel.expert import ExpertParallel
from k3train.parallel.expert_plan import capacity_per_pair, home_route
from k3train.parallel.state import ParallelState, resolve_layout


def small_config(**changes) -> ModelConfig:
    base = ModelConfig(num_hidden_layers=3, attn_res_block_size=2, recompute="none", balancer="quantile_histogram")
    return dataclasses.replace(base, **changes)


# ---------------------------------------------------------------------------- the dispatcher alone
def home_experts(config: ModelConfig, dispatcher: ExpertParallel, full: GroupedExperts, spec: dict) -> GroupedExperts:
    """This rank's home experts (slices of `full`), marked for `dispatcher`; with
    `spec["linear_backend"] == "te"` their GEMMs (home and replica slots) run through
    `kernels.te`'s GroupedLinear adapters on the CPU stand-in of Transformer Engine."""
    factory = None
    if spec.get("linear_backend", "torch") == "te":
        from k3train.kernels.te import TELinearFactory
        from tests.unit.te_stand_in import make_stand_in

        te = make_stand_in()
        STAND_IN["te"] = te
        factory = TELinearFactory(te, device="cpu").grouped
    mine = GroupedExperts(config, dispatcher.num_local_experts, factory, dispatcher.replica_slots).double()
    with torch.no_grad():
        for name in ("w1", "w3", "w2"):
            getattr(mine, name).copy_(getattr(full, name)[dispatcher.expert_offset :][: dispatcher.num_local_experts])
    dispatcher.mark_expert_params(mine)
    return mine


STAND_IN: dict[str, Any] = {}  # the TE stand-in namespace `home_experts` built last


def fp8_region(spec: dict):
    """`spec["fp8"]`: the stand-in's FP8 region (its GroupedLinear then also asserts every split
    is a multiple of 16 rows, as TE's FP8 GEMMs need; `kernels.te` pads the groups)."""
    if not spec.get("fp8"):
        return contextlib.nullcontext()
    from k3train.kernels.te import fp8_autocast

    return fp8_autocast(STAND_IN["te"], enabled=True)


def te_calls(experts: GroupedExperts) -> dict[str, int]:
    """GroupedLinear calls of the home and the replica GEMMs (zeros on the torch path), and of
    those the FP8 ones."""
    calls = {"home": 0, "replica": 0, "fp8": 0}
    for key, gemms in (("home", experts.te_gemms), ("replica", experts.te_replica_gemms)):
        for gemm in cast(Any, gemms) or []:
            calls[key] += gemm.gemm.fp8_calls + gemm.gemm.bf16_calls
            calls["fp8"] += gemm.gemm.fp8_calls
    return calls


def dispatcher_setup(env, spec: dict, experts_per_rank: int, seed: int, **dispatcher_options):
    """The dispatcher-alone checks' common start: a config with `experts_per_rank` experts per
    rank (top-4), this rank's `balanced` ExpertParallel over every rank, the single-process
    experts drawn from `seed` (×0.1) and this rank's home slices of them."""
    config = small_config(num_experts=experts_per_rank * env.world_size, num_experts_per_token=4)
    layout = resolve_layout(env.world_size, 1, 1, 0, env.world_size, 1, ModelSplitSizes.of(config))
    state = ParallelState(layout, env.rank)
    options = dict(
        transport=spec.get("transport", "relay"),
        replica_planning=spec.get("replica_planning", "online"),
        top_up_replicas=spec.get("top_up", 0),
    )
    options.update(dispatcher_options)
    max_replicas = options.pop("max_replicas", 2)
    dispatcher = ExpertParallel(state.ep, config.num_experts, "balanced", 1.25, max_replicas, **options)
    full = GroupedExperts(config, config.num_experts).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in full.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)
    return config, state, dispatcher, full, home_experts(config, dispatcher, full, spec)


# ---------------------------------------------------------------------------- per-source skew
def skewed_sources(env, spec: dict) -> dict:
    """The dispatcher alone under per-source skew: each rank routes its own hot experts (all on
    one other rank's home; half the ranks only), over several steps (replicas planned from the previous step). Every
    rank's output must equal the single-process experts on its tokens, and after `finish_step`
    the home experts' gradients the sum of the single-process gradients over all ranks."""
    config, state, dispatcher, full, mine = dispatcher_setup(env, spec, 8, seed=5)
    experts, top_k, width = config.num_experts, config.num_experts_per_token, config.expert_width
    local, ranks, tokens = dispatcher.num_local_experts, env.world_size, 64
    hot_home = (env.rank + 1) % ranks
    worst: dict[str, Any] = {"output_error": 0.0, "grad_error": 0.0, "dropped": [], "replicas": [], "max_home_pair": 0}
    for step in range(3):
        generator = torch.Generator().manual_seed(100 * step + env.rank)
        logits = torch.randn(tokens, experts, generator=generator, dtype=torch.float64)
        if env.rank < max(1, ranks // 2):  # only some sources have hot experts: the loads are skewed too
            logits[:, hot_home * local : hot_home * local + 3] += spec.get(
                "boost", 3.0
            )  # three hot experts of one home
        weights, ids = logits.sigmoid().topk(top_k, dim=-1)
        latent = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
        upstream = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
        out, info = dispatcher(latent, ids, weights, mine)
        (out * upstream).sum().backward()
        expected = full(latent, ids, weights * info.keep)  # a dropped slot counts as weight zero
        (expected * upstream).sum().backward()
        dispatcher.finish_step()
        worst["output_error"] = max(worst["output_error"], (out - expected).abs().max().item())
        worst["dropped"].append(int(state.ep.all_reduce(info.dropped.clone())))
        worst["replicas"].append(int(info.replicas))
        pairs = torch.bincount(home_route(ids.flatten(), local)[0], minlength=ranks)
        largest = state.ep.all_reduce(pairs.max().clone(), op=torch.distributed.ReduceOp.MAX)  # over all sources
        worst["max_home_pair"] = max(worst["max_home_pair"], int(largest))
        for name in ("w1", "w3", "w2"):
            total = state.ep.all_reduce(getattr(full, name).grad.clone())
            expected_grad = total[dispatcher.expert_offset :][:local]
            worst["grad_error"] = max(
                worst["grad_error"], (getattr(mine, name).grad - expected_grad).abs().max().item()
            )
    worst["pair_capacity"] = capacity_per_pair(tokens, top_k, ranks, 1.25)
    worst["te_calls"] = te_calls(mine)
    return worst


# ---------------------------------------------------------------------------- one set of experts
def concentrated_routing(env, spec: dict) -> dict:
    """The dispatcher alone when every token of every rank picks the same top-k experts, from the
    first micro-batch on (no earlier loads to plan from), then a sudden shift to another rank's
    experts: every slot must reach its expert (nothing dropped), outputs must equal the
    single-process experts on the same tokens, and the home experts' gradients the sum of the
    single-process gradients over the ranks (after `finish_step`, which `step` planning needs)."""
    config, state, dispatcher, full, mine = dispatcher_setup(
        env, spec, spec.get("experts_per_rank", 4), seed=9, max_replicas=spec.get("max_replicas", 2)
    )
    experts, top_k, width = config.num_experts, config.num_experts_per_token, config.expert_width
    local, tokens = dispatcher.num_local_experts, spec.get("tokens", 64)
    chosen = {"first_rank": list(range(top_k)), "last_rank": list(range(experts - top_k, experts))}
    worst: dict[str, Any] = {"output_error": 0.0, "grad_error": 0.0, "dropped": [], "replicas": []}
    for step, name in enumerate(chosen):
        generator = torch.Generator().manual_seed(200 * step + env.rank)
        ids = torch.tensor(chosen[name]).expand(tokens, top_k).contiguous()
        weights = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64)
        latent = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
        upstream = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
        with fp8_region(spec):
            out, info = dispatcher(latent, ids, weights, mine)
        (out * upstream).sum().backward()
        expected = full(latent, ids, weights)
        (expected * upstream).sum().backward()
        dispatcher.finish_step()
        worst["output_error"] = max(worst["output_error"], (out - expected).abs().max().item())
        worst["dropped"].append(int(state.ep.all_reduce(info.dropped.clone())))
        worst["replicas"].append(int(info.replicas))
        for weight in ("w1", "w3", "w2"):
            total = state.ep.all_reduce(getattr(full, weight).grad.clone())
            expected_grad = total[dispatcher.expert_offset :][:local]
            error = (getattr(mine, weight).grad - expected_grad).abs().max().item()
            worst["grad_error"] = max(worst["grad_error"], error)
    worst["te_calls"] = te_calls(mine)
    return worst


# ---------------------------------------------------------------------------- nodes
def node_dedup(env, spec: dict) -> dict:
    """The `nodes` transport on ranks taken as nodes of `gpus_per_node`: outputs, expert and
    routing-weight gradients as one process, and the inter-node bytes exactly one row (with its
    `k` destinations, ids and weights) per (token, remote node) its slots go to."""
    gpus_per_node = spec.get("gpus_per_node", 2)
    config, state, dispatcher, full, mine = dispatcher_setup(
        env, spec, 4, seed=13, transport="nodes", gpus_per_node=gpus_per_node
    )
    experts, top_k, width = config.num_experts, config.num_experts_per_token, config.expert_width
    tokens = 48
    generator = torch.Generator().manual_seed(300 + env.rank)
    logits = torch.randn(tokens, experts, generator=generator, dtype=torch.float64)
    logits[:, : experts // 4] += 1.0  # some skew: replicas are placed too
    top, ids = logits.sigmoid().topk(top_k, dim=-1)
    weights = top.clone().requires_grad_(True)
    reference_weights = top.clone().requires_grad_(True)
    latent = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
    upstream = torch.randn(tokens, width, generator=generator, dtype=torch.float64)
    before = dict(state.ep.counter.bytes)
    out, info = dispatcher(latent, ids, weights, mine)
    internode = state.ep.counter.bytes.get("ep.internode", 0) - before.get("ep.internode", 0)  # forward
    (out * upstream).sum().backward()
    expected = full(latent, ids, reference_weights)
    (expected * upstream).sum().backward()
    node = torch.tensor([rank // gpus_per_node for rank in state.ep.ranks])
    slot_node = node[info.dest]  # [s, k]
    mine_node = int(node[state.ep.rank])
    remote_rows = sum(len({int(n) for n in row if int(n) != mine_node}) for row in slot_node)
    remote_slots = int((slot_node != mine_node).sum())
    grad_error = 0.0
    for name in ("w1", "w3", "w2"):
        total = state.ep.all_reduce(getattr(full, name).grad.clone())
        expected_grad = total[dispatcher.expert_offset :][: dispatcher.num_local_experts]
        grad_error = max(grad_error, (getattr(mine, name).grad - expected_grad).abs().max().item())
    assert weights.grad is not None and reference_weights.grad is not None
    return {
        "output_error": (out - expected).abs().max().item(),
        "grad_error": grad_error,
        "weight_grad_error": (weights.grad - reference_weights.grad).abs().max().item(),
        "dropped": int(info.dropped),
        "replicas": int(info.replicas),
        "internode_bytes": internode,
        # per (token, remote node) row in the forward pass, float64 and int64: the latent out and
        # the node's weighted sum back (2 rows of `width`), the k destinations, k ids and k weights
        "bytes_per_remote_row": 2 * width * 8 + 3 * top_k * 8,
        "remote_rows": remote_rows,
        "remote_slots": remote_slots,
    }
