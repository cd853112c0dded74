"""Worker side of tests/distributed/test_muon_split.py: Newton–Schulz split over DP ranks
without ZeRO-1 (parallel/muon_split.py) against the unsplit replicated optimizer and one process.

One launch of 2 gloo ranks, `Layout(2, dp=2)`, the half-size debug model of
tests/distributed/workers_data.py in float64 (its single-process reference is reused). Returns
max absolute differences, Newton–Schulz FLOPs and the exchange traffic; the test asserts on them.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from k3train.model.k3 import K3ModelChunk
from k3train.optim.builder import build_optimizer, parameter_costs
from k3train.optim.config import OptimizerConfig
from k3train.optim.muon import PerHeadMuon
from k3train.optim.newton_schulz import ns_flops
from k3train.parallel.grad_reduce import GradientReducer, average_over_dp
from k3train.parallel.muon_split import install_muon_split
from k3train.parallel.state import Layout, ParallelState
from k3train.parallel.zero1 import DistributedOptimizer
from tests.distributed.workers_data import (
    BUCKET_BYTES,
    CONFIG,
    GLOBAL_BATCH,
    LR,
    STEPS,
    _batches,
    _loss,
    _max_diff,
    _model,
    _params,
    reference,
)


def _train(state: ParallelState, batches: torch.Tensor, split: bool) -> dict[str, Any]:
    model = _model(torch.float64)
    config = OptimizerConfig(lr=LR)
    optimizer = DistributedOptimizer(
        build_optimizer(model, config),
        model,
        state,
        parameter_costs(model, config),
        zero1=False,
        bucket_bytes=BUCKET_BYTES,
    )
    installed = (
        install_muon_split(optimizer.optimizer, model.named_parameters(), optimizer.plan.owners, state, BUCKET_BYTES)
        if split
        else None
    )
    reducer = GradientReducer(model, state, bucket_bytes=BUCKET_BYTES, overlap=True)
    local = GLOBAL_BATCH // state.layout.dp
    out: dict[str, Any] = {"losses": [], "ns_flops": [], "ns_seconds": [], "exchange": []}
    for step in range(STEPS):
        rows = batches[step][state.dp_rank * local : (state.dp_rank + 1) * local]
        loss = _loss(model, rows)
        loss.backward()
        reducer.finish()
        out["losses"].append(average_over_dp(loss.detach(), state).item())
        state.counter.reset()
        optimizer.step()
        out["exchange"].append(state.counter.snapshot().get("dp", (0, 0)))
        muon = optimizer.optimizer
        assert isinstance(muon, PerHeadMuon)  # OptimizerConfig's default optimizer
        stats = muon.step_stats
        out["ns_flops"].append(stats.ns_flops)
        out["ns_seconds"].append(stats.ns_seconds)
        optimizer.zero_grad()
    reducer.remove_hooks()
    out["params"] = _params(model)
    if installed is not None:
        out["expected_exchange"] = sum(e.length * 8 for e in installed.exchanges)
    return out


def run(env, payload: Any) -> dict[str, Any]:
    started = time.perf_counter()
    batches = _batches(CONFIG.vocab_size)
    box = [reference(batches) if env.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ref = box[0]
    assert ref is not None  # rank 0's reference, broadcast to every rank
    state = ParallelState(Layout(2, tp=1, pp=1, dp=2, ep=1), env.rank)
    plain = _train(state, batches, split=False)
    split = _train(state, batches, split=True)
    one = _model(torch.float64)
    single = build_optimizer(one, OptimizerConfig(lr=LR))
    assert isinstance(single, PerHeadMuon)  # OptimizerConfig's default optimizer
    total_ns_flops = sum(item.layout.flops() for item in single.work_items())
    return {
        "split_vs_plain": _max_diff(split["params"], plain["params"]),
        "split_vs_single": _max_diff(split["params"], ref["params"][STEPS]),
        "plain_vs_single": _max_diff(plain["params"], ref["params"][STEPS]),
        "loss_vs_single": max(abs(a - b) for a, b in zip(split["losses"], ref["losses"])),
        "ns_flops_split": split["ns_flops"],
        "ns_flops_plain": plain["ns_flops"],
        "ns_flops_single_process": total_ns_flops,
        "ns_seconds_split": split["ns_seconds"],
        "ns_seconds_plain": plain["ns_seconds"],
        "exchange_split": split["exchange"],
        "exchange_plain": plain["exchange"],
        "expected_exchange_bytes": split["expected_exchange"],
        "seconds": time.perf_counter() - started,
        "ns_flops_formula_check": ns_flops(3, 5, 1),
    }


def run_tensor_parallel(env, payload: Any) -> dict[str, Any]:
    """DP2 × TP2 on 4 ranks with a TP-sharded model: the split (its owners gather the sharded MLP
    matrices over TP and orthogonalise them whole) against the unsplit optimizer, and both
    against one process (each rank compares its TP slice)."""
    from tests.distributed.workers_tp import build_state, local_view, small_config

    config = small_config()
    state = build_state(env.world_size, env.rank, 2, False, config)
    generator = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, config.vocab_size, (4, 17), generator=generator) for _ in range(STEPS)]

    def trained(parallel: ParallelState | None, split: bool) -> tuple[dict[str, torch.Tensor], K3ModelChunk]:
        model = (K3ModelChunk(config, parallel=parallel) if parallel is not None else K3ModelChunk(config)).double()
        model.init_weights(seed=7)
        optimizer_config = OptimizerConfig(lr=LR)
        inner = build_optimizer(model, optimizer_config)
        optimizer: torch.optim.Optimizer | DistributedOptimizer = inner
        reducer = None
        if parallel is not None:
            optimizer = DistributedOptimizer(
                inner, model, parallel, parameter_costs(model, optimizer_config), zero1=False
            )
            if split:
                assert (
                    install_muon_split(optimizer.optimizer, model.named_parameters(), optimizer.plan.owners, parallel)
                    is not None
                )
            reducer = GradientReducer(model, parallel, overlap=False)
        for tokens in batches:
            rows = tokens if parallel is None else tokens[parallel.dp_rank * 2 : (parallel.dp_rank + 1) * 2]
            model.loss(model(rows[:, :-1]), rows[:, 1:]).backward()
            if reducer is not None:
                reducer.finish()
            optimizer.step()
            optimizer.zero_grad()
            model.update_routing_biases(parallel.dp if parallel is not None else None)
        return _params(model), model

    reference, _ = trained(None, False)
    plain, _ = trained(state, False)
    split, model = trained(state, True)
    to_reference = {}
    for name, param in model.named_parameters():
        to_reference[name] = local_view(reference[name], param, state.tp.size, state.tp.rank)
    return {
        "split_vs_plain": _max_diff(split, plain),
        "split_vs_single": _max_diff(split, to_reference),
        "plain_vs_single": _max_diff(plain, to_reference),
        "tp_sharded_muon": sum(getattr(p, "tensor_parallel", False) and p.ndim == 2 for p in model.parameters()),
    }
