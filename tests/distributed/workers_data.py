"""Worker side of tests/distributed/test_data_parallel.py: data parallelism against one process.

Everything runs in one launch of 4 gloo ranks (imports cost seconds per process on two cores):

- DP4: `Layout(4, tp=1, pp=1, dp=4)`, every rank a replica;
- DP2: `Layout(4, tp=2, pp=1, dp=2)` with an unsharded model, i.e. each "TP" pair holds two
  identical replicas of a replica — exactly what TP-replicated parameters are, so it also checks
  that the global norm counts them once.

Rank 0 also runs the single-process reference (same seed, the whole global batch) and hands its
losses, gradients and parameters to the other ranks, so nothing but numbers travels back to the
test. Each check returns max absolute differences and traffic counts; the test asserts on them
(tolerances are stated there).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from k3train.checkpoint import Checkpointer
from k3train.model.config import LinearAttnConfig, ModelConfig
from k3train.model.k3 import K3ModelChunk, lm_loss
from k3train.optim.builder import build_optimizer, parameter_costs
from k3train.optim.clip import clip_grad_norm_
from k3train.optim.config import OptimizerConfig
from k3train.parallel.grad_norm import clip_grad_norm
from k3train.parallel.grad_reduce import GradientReducer, average_over_dp
from k3train.parallel.state import Layout, ParallelState
from k3train.parallel.tensor import PartialGradParameter
from k3train.parallel.zero1 import DistributedOptimizer

Exchange = Literal["all_gather", "broadcast"]  # DistributedOptimizer's `exchange`

SEED = 3
STEPS = 3
GLOBAL_BATCH = 8
SEQ = 16
LR = 1e-2
BUCKET_BYTES = 1 << 17  # ~15 float64 buckets: exercises bucket ordering and exchange chunking


# The debug model at half width and depth: KDA and Gated MLA layers, dense and MoE FFNs, Block
# AttnRes over two blocks; 5x faster than the debug model on the shared CI cores.
CONFIG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    linear_attn_config=LinearAttnConfig(num_heads=4, head_dim=16),
    intermediate_size=128,
    num_experts=8,
    num_experts_per_token=2,
    moe_intermediate_size=32,
    routed_expert_hidden_size=32,
)


def _distributed_optimizer(
    model: K3ModelChunk, state: ParallelState, zero1: bool, exchange: Exchange = "all_gather"
) -> DistributedOptimizer:
    """The job's optimizer (built here, as the job builds it) under the ZeRO-1 wrapper."""
    config = OptimizerConfig(lr=LR)
    return DistributedOptimizer(
        build_optimizer(model, config),
        model,
        state,
        parameter_costs(model, config),
        zero1=zero1,
        exchange=exchange,
        bucket_bytes=BUCKET_BYTES,
    )


def _model(dtype: torch.dtype) -> K3ModelChunk:
    model = K3ModelChunk(CONFIG).to(dtype)
    model.init_weights(SEED)
    return model


def _batches(vocab: int) -> torch.Tensor:
    """[STEPS, GLOBAL_BATCH, SEQ + 1] token ids, the same on every rank."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, vocab, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=generator)


def _loss(model: K3ModelChunk, tokens: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(tokens[:, :-1]), tokens[:, 1:])


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _params(model: K3ModelChunk) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model: K3ModelChunk) -> dict[str, torch.Tensor]:
    """Gradients by name; parameters without one (layer 0's unused AttnRes) are left out, so
    the comparison also checks that the same ones have none."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------------------------
# The single-process reference


def reference(batches: torch.Tensor) -> dict[str, Any]:
    model = _model(torch.float64)
    optimizer = build_optimizer(model, OptimizerConfig(lr=LR))
    losses, grads, after = [], None, {}
    for step in range(STEPS):
        loss = _loss(model, batches[step])
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = _grads(model)
        optimizer.step()
        optimizer.zero_grad()
        after[step + 1] = _params(model)
    return {"losses": losses, "grads": grads, "params": after}


# ---------------------------------------------------------------------------------------------
# The data-parallel run


def train(
    state: ParallelState,
    batches: torch.Tensor,
    *,
    zero1: bool,
    exchange: Exchange = "all_gather",
    micro_batches: int = 1,
    overlap: bool = True,
    steps: int = STEPS,
    model: K3ModelChunk | None = None,
    optimizer: DistributedOptimizer | None = None,
    first_step: int = 0,
    after_step: Callable[[int, K3ModelChunk, DistributedOptimizer], None] | None = None,
) -> dict[str, Any]:
    """`steps` optimizer steps from `first_step` on this rank's rows of the global batches;
    `after_step(steps done, model, optimizer)` runs after each."""
    model = model or _model(torch.float64)
    optimizer = optimizer or _distributed_optimizer(model, state, zero1=zero1, exchange=exchange)
    # Under ZeRO-1 the buckets that pay for it are reduce-scattered to the owners, as in the job.
    reducer = GradientReducer(
        model, state, bucket_bytes=BUCKET_BYTES, overlap=overlap, owners=optimizer.gradient_owners()
    )
    local = GLOBAL_BATCH // state.layout.dp
    out: dict[str, Any] = {"losses": [], "grad_traffic": [], "exchange_traffic": [], "launched_in_backward": []}
    for step in range(first_step, first_step + steps):
        rows = batches[step][state.dp_rank * local : (state.dp_rank + 1) * local]
        state.counter.reset()
        loss_sum = torch.zeros((), dtype=torch.float64)
        for index, micro_batch in enumerate(rows.chunk(micro_batches)):
            last = index == micro_batches - 1
            with contextlib.nullcontext() if last else reducer.no_sync():
                loss = _loss(model, micro_batch)
                (loss / micro_batches).backward()
            loss_sum += loss.detach()
        out["launched_in_backward"].append(reducer._next_launch)
        reducer.finish()
        out["grad_traffic"].append(state.counter.snapshot())
        out["losses"].append(average_over_dp(loss_sum / micro_batches, state).item())
        if step == 0:
            out["grads"] = _grads(model)
        state.counter.reset()
        optimizer.step()
        out["exchange_traffic"].append(state.counter.snapshot())
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step + 1, model, optimizer)
    reducer.remove_hooks()
    out.update(model=model, optimizer=optimizer, reducer=reducer, params=_params(model))
    return out


def _expected_grad_names(run: dict[str, Any], ref: dict[str, Any]) -> set[str]:
    """The gradients this rank must hold after `finish`: every one the reference has, except
    those of reduce-scattered buckets that another rank owns."""
    reducer = run["reducer"]
    names = {id(p): n for n, p in run["model"].named_parameters()}
    elsewhere = {
        names[id(p)]
        for b in reducer.buckets
        if b.sharded
        for p, owner in zip(b.params, b.owners)
        if owner != b.reduction.group.rank
    }
    return set(ref["grads"]) - elsewhere


def _compare(run: dict[str, Any], ref: dict[str, Any], first_step: int = 0) -> dict[str, float]:
    steps = len(run["losses"])
    result = {
        "loss": max(abs(a - b) for a, b in zip(run["losses"], ref["losses"][first_step : first_step + steps])),
        "params": _max_diff(run["params"], ref["params"][first_step + steps]),
    }
    if "grads" in run:
        # Non-owners hold no gradient of a reduce-scattered parameter (checked by the key sets).
        expected = _expected_grad_names(run, ref)
        result["grads"] = _max_diff(run["grads"], {k: v for k, v in ref["grads"].items() if k in expected})
    return result


def _expected_exchange(optimizer: DistributedOptimizer) -> tuple[int, int]:
    """(bytes, messages) this rank should count for one ZeRO-1 parameter exchange."""
    total_bytes = messages = 0
    for exchange in optimizer._exchanges:
        element = torch.empty((), dtype=exchange.dtype).element_size()
        if optimizer.exchange == "all_gather":
            chunk = BUCKET_BYTES // element
            mine = [p for p, owner in exchange.broadcast if owner == exchange.group.rank]
            total_bytes += exchange.length * element + sum(p.numel() for p in mine) * element
            messages += math.ceil(exchange.length / chunk) + len(mine)
        else:
            owned = exchange.per_rank[exchange.group.rank]
            total_bytes += sum(p.numel() for p, _ in owned) * element
            messages += len(owned)
    return total_bytes, messages


def _traffic(run: dict[str, Any], reducer: GradientReducer, optimizer: DistributedOptimizer) -> dict[str, Any]:
    model_numel = sum(p.numel() for p in run["model"].parameters())
    return {
        "model_tensors": len(list(run["model"].parameters())),
        "grad": run["grad_traffic"][-1].get("dp", (0, 0)),
        "grad_expected": (reducer.bytes_per_step().get("dp", 0), len(reducer.buckets)),
        "model_numel": model_numel,
        "exchange": run["exchange_traffic"][-1].get("dp", (0, 0)),
        "exchange_expected": _expected_exchange(optimizer),
    }


# ---------------------------------------------------------------------------------------------
# Clipping (float32: clip_grad_norm_ norms in fp32, which it cannot do for float64 gradients)


def clip_check(state: ParallelState, batches: torch.Tensor, zero1: bool = False) -> dict[str, Any]:
    """Clipping by the global norm; with `zero1`, gradients reduce-scattered to their owners
    (each rank clips its own, the norm still the single process's)."""
    reference_model = _model(torch.float32)
    _loss(reference_model, batches[0]).backward()
    ref_norm = clip_grad_norm_(list(reference_model.parameters()), math.inf).item()
    max_norm = 0.5 * ref_norm  # clips
    clip_grad_norm_(list(reference_model.parameters()), max_norm)
    ref_clipped = _grads(reference_model)

    model = _model(torch.float32)
    owners = _distributed_optimizer(model, state, zero1=True).gradient_owners() if zero1 else None
    reducer = GradientReducer(model, state, bucket_bytes=BUCKET_BYTES, owners=owners)
    local = GLOBAL_BATCH // state.layout.dp
    state.counter.reset()
    _loss(model, batches[0][state.dp_rank * local : (state.dp_rank + 1) * local]).backward()
    reducer.finish()
    traffic = state.counter.snapshot().get("dp", (0, 0))
    norm = clip_grad_norm(model.parameters(), max_norm, state).item()
    reducer.remove_hooks()
    held = _grads(model)
    return {
        "norm": norm,
        "reference_norm": ref_norm,
        "clipped_grads": _max_diff(held, {k: v for k, v in ref_clipped.items() if k in held}),
        "held_grads": sorted(held),
        "sharded_buckets": sum(b.sharded for b in reducer.buckets),
        "grad_scale": max(g.abs().max().item() for g in ref_clipped.values()),
        "fp32_grad_traffic": traffic,
        "fp32_expected": (4 * sum(p.numel() + 1 for p in model.parameters()), len(reducer.buckets)),
    }


# ---------------------------------------------------------------------------------------------
# TP-partial gradients (parallel/tensor.py's `tp_partial_grad`)


def tp_partial_check(
    state: ParallelState, batches: torch.Tensor, ref: dict[str, Any], zero1: bool = False
) -> dict[str, Any]:
    """DP2 x "TP"2 where each TP rank takes half of its replica's rows and 1/tp of its loss, as
    a sequence-parallel rank sees part of the tokens: with every parameter marked
    `tp_partial_grad`, the one SUM over `data_tensor` / dp must give the global gradient. With
    `zero1`: reduce-scattered over dp to the owners, whose segment is then summed over tp; the
    owners' gradients must be the global ones."""
    model = _model(torch.float64)
    for param in model.parameters():
        cast(PartialGradParameter, param).tp_partial_grad = True
    owners = _distributed_optimizer(model, state, zero1=True).gradient_owners() if zero1 else None
    reducer = GradientReducer(model, state, bucket_bytes=BUCKET_BYTES, owners=owners)
    tp = state.layout.tp
    rows = GLOBAL_BATCH // (state.layout.dp * tp)
    first = (state.dp_rank * tp + state.tp_rank) * rows
    state.counter.reset()
    (_loss(model, batches[0][first : first + rows]) / tp).backward()
    reducer.finish()
    reducer.remove_hooks()
    held = _grads(model)
    if zero1:
        return {
            "grads": _max_diff(held, {name: ref["grads"][name] for name in held}),
            "held": sorted(held),
            "traffic": state.counter.snapshot(),
            "expected": reducer.bytes_per_step(),
            "two_phase_buckets": sum(b.then_over is not None for b in reducer.buckets),
            "buckets": len(reducer.buckets),
        }
    return {
        "grads": _max_diff(held, ref["grads"]),
        "traffic": state.counter.snapshot(),
        "expected": (reducer.bytes_per_step(), len(reducer.buckets)),
    }


# ---------------------------------------------------------------------------------------------
# Entry point


def run(env, payload: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    batches = _batches(CONFIG.vocab_size)
    # Rank 0 runs the single process; the others would repeat the same work on shared cores.
    box = [reference(batches) if env.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ref = box[0]
    assert ref is not None  # rank 0's reference, broadcast to every rank
    trained = len(ref["grads"])  # tensors with a gradient (layer 0's unused AttnRes has none)
    results: dict[str, Any] = {"seconds": {}, "trained_tensors": trained}
    dp4 = ParallelState(Layout(4, tp=1, pp=1, dp=4, ep=1), env.rank)
    dp2 = ParallelState(Layout(4, tp=2, pp=1, dp=2, ep=1), env.rank)
    results["seconds"]["reference"] = time.perf_counter() - started

    # For the reshard check: the DP2 + ZeRO-1 run leaves its state after two steps, both as the
    # union of every rank's by-name state dict and as a Checkpointer save of `optimizer.optimizer`.
    checkpointer = Checkpointer(payload["checkpoint_dir"], keep_last=0)
    saved: dict[str, Any] = {}

    def save_after_two(done: int, model: K3ModelChunk, optimizer: DistributedOptimizer) -> None:
        if done != 2:
            return
        states: list[Any] = [None] * env.world_size
        dist.all_gather_object(states, optimizer.state_dict())
        saved["union"] = {
            "state": {k: v for s in states for k, v in s["state"].items()},
            "param_groups": states[0]["param_groups"],
        }
        saved["model"] = {k: v.clone() for k, v in model.state_dict().items()}
        saved["path"] = checkpointer.save(2, {"model": model, "optimizer": optimizer.optimizer})
        saved["entries"] = len(optimizer.optimizer.state)

    for label, state in (("dp4", dp4), ("dp2", dp2)):
        t0 = time.perf_counter()
        off = train(state, batches, zero1=False)
        on = train(state, batches, zero1=True, after_step=save_after_two if label == "dp2" else None)
        with_grad = {id(p) for run in (on, off) for n, p in run["model"].named_parameters() if n in ref["grads"]}
        names = {id(p): n for run in (on, off) for n, p in run["model"].named_parameters()}
        plan = on["optimizer"].plan
        results[label] = {
            "zero_off": _compare(off, ref),
            "zero_on": _compare(on, ref),
            "on_vs_off": _max_diff(on["params"], off["params"]),
            "traffic_zero_on": _traffic(on, on["reducer"], on["optimizer"]),
            "traffic_zero_off": _traffic(off, off["reducer"], off["optimizer"]),
            # Buckets launch in order, so the first one holding a parameter that gets no gradient
            # (layer 0's unused AttnRes query, last in backward) waits for finish().
            **{
                f"{key}_{zero}": value
                for zero, run in (("on", on), ("off", off))
                for key, value in (
                    ("launched_in_backward", run["launched_in_backward"]),
                    ("buckets", len(run["reducer"].buckets)),
                    (
                        "first_unused_bucket",
                        min(b.index for b in run["reducer"].buckets if any(id(p) not in with_grad for p in b.params)),
                    ),
                    ("bucket_names", [[names[id(p)] for p in b.params] for b in run["reducer"].buckets]),
                )
            },
            "plan": {"owners": plan.owners, "costs": plan.costs, "numels": plan.numels, "describe": plan.describe()},
            "owned_state_entries": len(on["optimizer"].optimizer.state),
            "grad_names_zero_on": sorted(on["grads"]),
            "expected_grad_names": sorted(_expected_grad_names(on, ref)),
            "sharded_buckets": sum(b.sharded for b in on["reducer"].buckets),
        }
        results["seconds"][label] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # Gradient accumulation: 2 micro-batches per rank, ZeRO-1 on.
    accumulated = train(dp4, batches, zero1=True, micro_batches=2)
    results["accumulation"] = _compare(accumulated, ref)
    # Broadcast exchange (and no overlap: everything reduced in finish()): same parameters.
    broadcast = train(dp4, batches, zero1=True, exchange="broadcast", overlap=False, steps=1)
    results["broadcast"] = {
        "params": _max_diff(broadcast["params"], ref["params"][1]),
        "grads": _compare(broadcast, ref)["grads"],
        "launched_in_backward": broadcast["launched_in_backward"],
        "traffic": _traffic(broadcast, broadcast["reducer"], broadcast["optimizer"]),
    }
    results["seconds"]["accumulation_broadcast"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    results["clip_dp4"] = clip_check(dp4, batches)
    results["clip_dp2_tp2"] = clip_check(dp2, batches)
    results["clip_dp4_zero1"] = clip_check(dp4, batches, zero1=True)
    results["clip_dp2_tp2_zero1"] = clip_check(dp2, batches, zero1=True)
    results["tp_partial"] = tp_partial_check(dp2, batches, ref)
    results["tp_partial_zero1"] = tp_partial_check(dp2, batches, ref, zero1=True)
    results["seconds"]["clip"] = time.perf_counter() - t0

    # Resharding: step 3 under DP4 + ZeRO-1 from the DP2 state after step 2.
    t0 = time.perf_counter()
    model = _model(torch.float64)
    model.load_state_dict(saved["model"])
    optimizer = _distributed_optimizer(model, dp4, zero1=True)
    optimizer.load_state_dict(saved["union"])
    by_name = train(dp4, batches, zero1=True, steps=1, first_step=2, model=model, optimizer=optimizer)

    model = _model(torch.float64)
    optimizer = _distributed_optimizer(model, dp4, zero1=True)
    checkpointer.load(saved["path"], {"model": model, "optimizer": optimizer.optimizer})
    loaded_entries = len(optimizer.optimizer.state)
    from_checkpoint = train(dp4, batches, zero1=True, steps=1, first_step=2, model=model, optimizer=optimizer)
    results["reshard"] = {
        "by_name": _compare(by_name, ref, first_step=2)["params"],
        "checkpoint": _compare(from_checkpoint, ref, first_step=2)["params"],
        "saved_entries_dp2": saved["entries"],
        "loaded_entries_dp4": loaded_entries,
    }
    results["seconds"]["reshard"] = time.perf_counter() - t0
    results["seconds"]["total"] = time.perf_counter() - started
    return results
