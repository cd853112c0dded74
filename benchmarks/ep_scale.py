"""Expert parallelism at K3 scale, in one process: drops and wire bytes for R = 8 … 448 ranks.

Runs the real planner, slot routing, relay plan and drop rules (`parallel/expert_plan.py`) for
every simulated source rank, on synthetic routing with K3's shapes (896 experts, top-16, latent
3584, expert width 3072, 2,048 tokens per rank and micro-batch, at most 2 replicas per rank), and
the same for two earlier revisions loaded from git into temporary modules, side by side:
`--old-revision` (the earlier dispatch code: per-pair buffers, replicas fetched per
micro-batch) and `--previous-revision` (per-destination receive buffers and replicas once per
step, with its `padded` default and its exact `splits` transport).

Routing regimes (each source's logits `noise + global bias + its own bias`, top-k):
* `global`: every expert has a fixed bias `N(0, global_skew)` (some experts hot everywhere);
* `per_source`: the global bias, plus each source's own `hot` experts boosted by `boost`
  (documents with their own topics): the skew the (source, destination) pairs see.

Replicas: planned from the previous step's loads (a second draw of the same regime), the
measured step routed within them; the old revision plans per micro-batch.

Bytes per rank and step (`--micro-batches` micro-batches, bf16 rows, int32 ids), what the
busiest rank sends: tokens = dispatch + combine, forward + backward; replicas = weights forward
+ gradients backward. "×min" is against the unpadded minimum (every slot's row once each way).
896 experts split evenly over 256 ranks is impossible (896 = 2^7·7); 224 and 448 are the valid
sizes around it.

    python benchmarks/ep_scale.py                      # R = 8, 64, 224, both regimes, all codes
    python benchmarks/ep_scale.py --ranks 64 --regimes per_source --boost 1.5
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3train.parallel import expert_placement
from k3train.parallel import expert_plan as plan
from k3train.parallel import expert_spread as spread

ROOT = Path(__file__).resolve().parents[1]


def load_old_module(revision: str, path: str = "parallel/expert.py"):
    """`path` as it was at `revision`, imported as a temporary module."""
    source = subprocess.run(
        ["git", "show", f"{revision}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    name = f"old_{revision}_{Path(path).stem}"
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None, f"{file} is a .py file, which always has a loader"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class KernelCounter(TorchDispatchMode):
    """Operations run inside it that launch a kernel (views do not)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.kernels += not func.is_view
        return func(*args, **(kwargs or {}))


def planning_kernels(planner, load, ranks: int, replicas: int) -> int:
    counter = KernelCounter()
    with counter:
        planner(load, ranks, replicas)
    return counter.kernels


def routing(args, ranks: int, regime: str, step: int):
    """Per source: expert ids `[R, s, k]`, weights, and counts `[R, E]`; the biases are fixed per
    regime (seeded by R), the noise differs per step."""
    experts, tokens, top_k = args.experts, args.tokens, args.top_k
    biases = torch.Generator().manual_seed(1000 + ranks)
    global_bias = torch.randn(experts, generator=biases) * args.global_skew
    own_hot = [torch.randperm(experts, generator=biases)[: args.hot] for _ in range(ranks)]
    noise = torch.Generator().manual_seed(10 * ranks + step)
    ids = torch.empty(ranks, tokens, top_k, dtype=torch.int64)
    weights = torch.empty(ranks, tokens, top_k)
    for source in range(ranks):
        logits = torch.randn(tokens, experts, generator=noise) + global_bias
        if regime == "per_source":
            logits[:, own_hot[source]] += args.boost
        elif regime == "lognormal":  # each source's own popularity per expert, log-normal
            logits += torch.randn(experts, generator=biases) * args.lognormal_sigma
        elif regime == "concentrated":  # every token picks the same top-k experts (0 … k−1)
            logits[:, :top_k] += 100.0
        top, index = logits.sigmoid().topk(top_k, dim=-1)
        ids[source], weights[source] = index, top / top.sum(-1, keepdim=True)
    counts = torch.zeros(ranks, experts, dtype=torch.int64)
    for source in range(ranks):
        counts[source].index_add_(0, ids[source].flatten(), torch.ones(tokens * top_k, dtype=torch.int64))
    return ids, weights, counts


def step_placement(plan_module, args, ranks, previous_load):
    """The step's replica placement, planned from the previous step's loads (as `finish_step` does)."""
    # this tree plans placements with its greedy (once per step), older ones with `plan_from_load`
    planner = getattr(plan_module, "greedy_plan_from_load", plan_module.plan_from_load)
    first = planner(previous_load, ranks, args.max_replicas, args.tolerance)
    # this tree's placements live in their own module; older revisions kept them in the planner's
    placement = getattr(plan_module, "ReplicaPlacement", expert_placement.ReplicaPlacement).from_plan(first)
    if not args.no_spares:
        placement = placement.with_spares(previous_load, first.rank_load, args.max_replicas)
    return placement


def replica_traffic(args, ranks, placement):
    """Replica matrices the busiest rank sends per step: weights from the home, gradients back."""
    outgoing = torch.zeros(ranks, dtype=torch.int64)
    local = args.experts // ranks
    for expert, dest, _ in placement.host:
        outgoing[expert // local] += 1
        outgoing[dest] += 1
    return int(outgoing.max())


def new_code(args, ranks, ids, weights, counts, previous_load):
    """This tree's default: `balanced` with the `relay` transport (two fixed-shape hops)."""
    slots = args.tokens * args.top_k
    placement = step_placement(plan, args, ranks, previous_load)
    replica_plan = plan.apply_placement(
        counts, placement, plan.capacity_per_destination(args.tokens, args.top_k, ranks, args.capacity_factor)
    )
    shares = plan.proportional_shares(counts, replica_plan)
    pairs = plan.proportional_pairs(counts, replica_plan, shares)
    capacity = plan.relay_capacity(args.tokens, args.top_k, ranks, args.capacity_factor)
    relay_plan = plan.plan_relay(pairs, capacity)
    dropped = 0
    for source in range(ranks):  # the real per-source routing and packing
        dest, _ = plan.proportional_route(ids[source].flatten(), counts, source, replica_plan, shares)
        position = plan.pair_positions(dest, weights[source].flatten(), ranks)
        dropped += int((~plan.relay_route(dest, position, source, relay_plan)[1]).sum())
    assert dropped == int(relay_plan.dropped.sum())
    rows = ranks * capacity.rows  # every rank, each all-to-all direction
    return {
        "dropped": dropped / (ranks * slots),
        "over": int((pairs - capacity.first).max()),
        "capacity": f"{capacity.first}+{capacity.second}",
        "token_rows": 4 * rows,
        "token_ids": rows,
        "replica_matrices_step": replica_traffic(args, ranks, placement),
        "replicas": placement.num_replicas,
    }


def online_code(args, ranks, ids, weights, counts, transport):
    """Replicas planned per micro-batch from its own loads (`ep_replica_planning: online`), with
    the `spread` transport (the GPU default where NVSHMEM is missing) or the `relay` one."""
    slots = args.tokens * args.top_k
    destination = plan.capacity_per_destination(args.tokens, args.top_k, ranks, args.capacity_factor)
    replica_plan = plan.plan_from_load(counts.sum(0), ranks, args.max_replicas)
    replicas = int(replica_plan.num_replicas)
    if transport == "relay":
        shares = plan.proportional_shares(counts, replica_plan)
        pairs = plan.proportional_pairs(counts, replica_plan, shares)
        capacity = plan.relay_capacity(args.tokens, args.top_k, ranks, args.capacity_factor)
        dropped = int(plan.plan_relay(pairs, capacity).dropped.sum())
        first, second = capacity.first, capacity.second
    else:
        pairs = plan.pair_slots(counts, replica_plan)
        spread_cap = spread.spread_capacity(slots, ranks, destination)
        spread_plan = spread.plan_spread(pairs, spread_cap)
        dropped = node_rows = remote_slots = 0
        for source in range(ranks):  # the real per-source routing
            dest, _ = plan.replica_route(ids[source].flatten(), counts, source, replica_plan)
            position = plan.pair_positions(dest, weights[source].flatten(), ranks)
            dropped += int((~spread.spread_kept(dest, position, source, spread_plan)).sum())
            # the `nodes` transport at `--gpus-per-node`: rows crossing between nodes, once per
            # (token, remote node), against one per slot with a remote expert
            node = (dest // args.gpus_per_node).view(args.tokens, args.top_k)
            remote = node != source // args.gpus_per_node
            remote_slots += int(remote.sum())
            keys = torch.arange(args.tokens)[:, None] * ranks + node
            node_rows += int(torch.unique(keys[remote]).numel())
        assert dropped == int(spread_plan.dropped.sum())
        first, second = spread_cap.first, spread_cap.second
    rows = ranks * (first + second)
    per_node = f"{remote_slots / max(node_rows, 1):.2f}" if transport == "spread" else "-"
    return {
        "dropped": dropped / (ranks * slots),
        "over": int((replica_plan.rank_load - destination).max()),
        "capacity": f"{first}+{second}",
        "token_rows": 4 * rows,
        "token_ids": rows,
        # the [R, M, F] equal-split exchange, weights and their gradients: 2·R·M matrices
        "replica_matrices_micro_batch": 2 * ranks * args.max_replicas,
        "replicas": replicas,
        "slots_per_node_row": per_node,
        # the per-dispatch plan's kernels, and the greedy's (the planner before) on the same loads
        "plan_kernels": f"{planning_kernels(plan.plan_from_load, counts.sum(0), ranks, args.max_replicas)}"
        f"/{planning_kernels(plan.greedy_plan_from_load, counts.sum(0), ranks, args.max_replicas)}",
    }


def exact_code(args, ranks, ids, weights, counts, previous_load):
    """`exact` (the rows that exist, a fixed `[C_dest]` receive buffer, device split sizes) with
    `step` replicas topped up per micro-batch (`--top-up` slots): the step's placement from the
    previous step's loads, this micro-batch's top-ups where a rank would pass `C_dest`."""
    destination = plan.capacity_per_destination(args.tokens, args.top_k, ranks, args.capacity_factor)
    placement = step_placement(plan, args, ranks, previous_load)
    merged = expert_placement.top_up_placement(counts, placement, destination, args.top_up, args.capacity_factor - 1)
    replica_plan = plan.apply_placement(counts, merged, destination)
    placed = ranks * args.max_replicas
    top_ups = expert_placement.ReplicaPlacement(
        replica_plan.expert[placed:],
        replica_plan.dest[placed:],
        replica_plan.slot[placed:],
        replica_plan.valid[placed:],
    )
    return {
        **exact_rows(args, ranks, counts, replica_plan),
        "replica_matrices_step": replica_traffic(args, ranks, placement),
        # the counted top-up fetch: only the top-ups this micro-batch placed, weights and gradients
        "replica_matrices_micro_batch": replica_traffic(args, ranks, top_ups),
        "top_ups": int(top_ups.valid.sum()),
    }


def exact_online_code(args, ranks, ids, weights, counts):
    """`exact` with `online` replicas (the library's GPU default): every micro-batch plans its own
    (`plan_from_load`) and fetches them through the counted exchange, each replicated matrix
    once to each rank hosting it."""
    replica_plan = plan.plan_from_load(counts.sum(0), ranks, args.max_replicas)
    online = expert_placement.ReplicaPlacement(
        replica_plan.expert, replica_plan.dest, replica_plan.slot, replica_plan.valid
    )
    return {
        **exact_rows(args, ranks, counts, replica_plan),
        "replica_matrices_micro_batch": replica_traffic(args, ranks, online),
    }


def exact_rows(args, ranks, counts, replica_plan):
    """Drops and token rows of the `exact` transport under `replica_plan`, and the `nodes`
    transport's drops under the same plan."""
    slots = args.tokens * args.top_k
    destination = plan.capacity_per_destination(args.tokens, args.top_k, ranks, args.capacity_factor)
    pairs = plan.pair_slots(counts, replica_plan)
    room = plan.destination_room(pairs, destination)
    out_rows, in_rows = room.sum(1), room.sum(0)  # dispatch sends `out`, combine sends `in`
    return {
        "dropped": int((pairs - room).sum()) / (ranks * slots),
        "over": int((replica_plan.rank_load - destination).max()),
        "capacity": f"{destination}",
        "token_rows": 2 * int((out_rows + in_rows).max()),
        "token_ids": int(out_rows.max()),
        "replicas": int(replica_plan.num_replicas),
        "nodes_dropped": nodes_drops(args, ranks, counts, replica_plan)[0] / (ranks * slots),
    }


def nodes_drops(args, ranks, counts, replica_plan) -> tuple[int, int]:
    """The `nodes` transport's drops under `replica_plan` (`node_rooms`: each destination within
    `C_dest`, each gateway's forwards within the same capacity) and its inter-node rows are not
    simulated here; returns (slots dropped, slots routed)."""
    from k3train.parallel.comm import Group, TrafficCounter
    from k3train.parallel.expert_nodes import NodeLayout, node_rooms

    group = Group("ep", tuple(range(ranks)), 0, None, TrafficCounter())
    layout = NodeLayout(group, args.gpus_per_node)
    destination = plan.capacity_per_destination(args.tokens, args.top_k, ranks, args.capacity_factor)
    pairs = plan.pair_slots(counts, replica_plan)
    _, grant = node_rooms(pairs, layout, destination)
    return int(pairs.sum() - grant.sum()), int(pairs.sum())


def previous_code(args, previous, ranks, ids, weights, counts, previous_load, transport):
    """The tree before the relay transport (main at `--previous-revision`): `balanced` with one
    `[C_dest]` receive buffer per destination, `padded` (its default: `R·s·k` rows per
    all-to-all) or `splits` (exact rows, split sizes read on the host)."""
    slots = args.tokens * args.top_k
    capacity = previous.capacity_per_destination(args.tokens, args.top_k, ranks, args.capacity_factor)
    placement = step_placement(previous, args, ranks, previous_load)
    replica_plan = previous.apply_placement(counts, placement, capacity)
    room = previous.destination_room(previous.pair_slots(counts, replica_plan), capacity)
    dropped = 0
    for source in range(ranks):
        dest, _ = previous.replica_route(ids[source].flatten(), counts, source, replica_plan)
        _, keep = previous.pack_slots(dest, weights[source].flatten(), ranks, room[source])
        dropped += int((~keep).sum())
    if transport == "padded":
        rows, ids_sent = 4 * ranks * slots, ranks * slots
    else:
        sent, returned = room.sum(1), room.sum(0)
        rows, ids_sent = int((2 * (sent + returned)).max()), int(sent.max())
    return {
        "dropped": dropped / (ranks * slots),
        "over": int((replica_plan.rank_load - capacity).max()),
        "capacity": capacity,
        "token_rows": rows,
        "token_ids": ids_sent,
        "replica_matrices_step": replica_traffic(args, ranks, placement),
        "replicas": placement.num_replicas,
    }


def old_code(args, old, ranks, ids, weights, counts):
    slots = args.tokens * args.top_k
    capacity = old.capacity_per_pair(args.tokens, args.top_k, ranks, args.capacity_factor)
    plan = old.plan_replicas(counts, args.max_replicas)
    dropped, largest = 0, 0
    for source in range(ranks):
        dest, _ = old.balanced_route(ids[source].flatten(), counts, source, plan)
        _, keep = old.pack_slots(dest, weights[source].flatten(), ranks, capacity)
        dropped += int((~keep).sum())
        largest = max(largest, int(torch.bincount(dest, minlength=ranks).max()))
    return {
        "dropped": dropped / (ranks * slots),
        "over": largest - capacity,
        "capacity": capacity,
        "token_rows": 4 * ranks * capacity,
        "token_ids": ranks * capacity,
        "replica_matrices_micro_batch": 2 * ranks * args.max_replicas,
        "replicas": int(plan.num_replicas),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--ranks",
        type=int,
        nargs="*",
        default=[8, 64, 224],
        help="EP sizes; each must divide --experts (896 = 2^7·7: 256 does not, 224 and 448 do)",
    )
    parser.add_argument("--regimes", nargs="*", default=["global", "per_source"], help="also: lognormal, concentrated")
    parser.add_argument("--lognormal-sigma", type=float, default=1.0, help="lognormal: σ of log-popularity")
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank and micro-batch")
    parser.add_argument("--latent", type=int, default=3584)
    parser.add_argument("--inner", type=int, default=3072)
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--tolerance", type=float, default=0.05, help="planner: relieve ranks above (1+t)·mean")
    parser.add_argument("--no-spares", action="store_true", help="do not fill free replica slots")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=16,
        help="micro-batches per step (recipes/k3.yaml: 16.8M tokens over 512 routing ranks "
        "= 32K tokens per rank and step = 16 micro-batches of 2048)",
    )
    parser.add_argument("--global-skew", type=float, default=0.1)
    parser.add_argument("--hot", type=int, default=8, help="per_source: each source's own hot experts")
    parser.add_argument("--boost", type=float, default=0.8, help="per_source: logit boost of the own hot experts")
    parser.add_argument(
        "--old-revision",
        default="222b10e",
        help="git revision of the earlier dispatch code (per-pair buffers, replicas per micro-batch); '' to skip",
    )
    parser.add_argument(
        "--previous-revision",
        default="3c49d31",
        help="git revision before the relay transport (destination buffers, padded/splits); '' to skip",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top-up", type=int, default=2, help="exact rows: top-up slots per rank after the step's")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="for the once-per-node row count")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for ranks in args.ranks:
        if args.experts % ranks:
            parser.error(
                f"--ranks {ranks} does not divide --experts {args.experts}: experts are split evenly over the EP ranks"
            )
    old = load_old_module(args.old_revision) if args.old_revision else None
    previous = load_old_module(args.previous_revision, "parallel/expert_plan.py") if args.previous_revision else None
    element, micro = 2, args.micro_batches
    matrix = 3 * args.inner * args.latent * element
    minimum = 4 * args.tokens * args.top_k * args.latent * element * micro  # bytes/rank/step, unpadded
    print(
        f"K3 shapes: {args.experts} experts, top-{args.top_k}, latent {args.latent}, I {args.inner}, "
        f"{args.tokens} tokens/rank/micro-batch, {micro} micro-batches/step, max {args.max_replicas} replicas/rank, "
        f"capacity_factor {args.capacity_factor}; bytes per rank per step (busiest rank), bf16; "
        f"token minimum {minimum / 2**30:.2f} GiB"
    )
    header = (
        "R",
        "routing",
        "code",
        "skew",
        "dropped",
        "over cap",
        "cap",
        "replicas",
        "token GiB",
        "×min",
        "replica GiB",
        "replica/token",
        "slots/node row",
        "plan kernels",
    )
    print(" | ".join(f"{h:>11}" for h in header))
    for ranks in args.ranks:
        for regime in args.regimes:
            started = time.perf_counter()
            _, _, previous_load = routing(args, ranks, regime, step=0)
            ids, weights, counts = routing(args, ranks, regime, step=1)
            mean = args.tokens * args.top_k / args.experts
            load = counts.sum(0).double()
            skew = f"{(load.max() / load.mean()).item():.1f}/{(counts.double().topk(args.hot, dim=1).values.mean() / mean).item():.1f}"
            rows = []
            if old is not None:
                rows.append((args.old_revision, old_code(args, old, ranks, ids, weights, counts)))
            if previous is not None:
                for transport in ("padded", "splits"):
                    rows.append(
                        (
                            f"{args.previous_revision} {transport}",
                            previous_code(args, previous, ranks, ids, weights, counts, previous_load.sum(0), transport),
                        )
                    )
            rows.append(("relay step", new_code(args, ranks, ids, weights, counts, previous_load.sum(0))))
            # the first step (or a resume at another ep, or a sudden shift): no placement to route with
            first_step = torch.zeros(args.experts, dtype=torch.int64)
            rows.append(("relay step 0", new_code(args, ranks, ids, weights, counts, first_step)))
            rows.append(("relay online", online_code(args, ranks, ids, weights, counts, "relay")))
            rows.append(("spread online", online_code(args, ranks, ids, weights, counts, "spread")))
            rows.append(("exact online", exact_online_code(args, ranks, ids, weights, counts)))
            rows.append(("exact step+top-up", exact_code(args, ranks, ids, weights, counts, previous_load.sum(0))))
            rows.append(("exact step 0+top-up", exact_code(args, ranks, ids, weights, counts, first_step)))
            for label, result in rows:
                token_bytes = (result["token_rows"] * args.latent * element + result["token_ids"] * 4) * micro
                replica_bytes = result.get("replica_matrices_step", 0) * matrix
                replica_bytes += result.get("replica_matrices_micro_batch", 0) * matrix * micro
                cells = (
                    ranks,
                    regime,
                    label,
                    skew,
                    f"{100 * result['dropped']:.3f}%",
                    result["over"],
                    result["capacity"],
                    result["replicas"],
                    f"{token_bytes / 2**30:.2f}",
                    f"{token_bytes / minimum:.3f}",
                    f"{replica_bytes / 2**30:.3f}",
                    f"{100 * replica_bytes / token_bytes:.1f}%",
                    result.get("slots_per_node_row", "-"),
                    result.get("plan_kernels", "-"),
                )
                print(" | ".join(f"{str(c):>11}" for c in cells))
                if "nodes_dropped" in result:  # the same plan through the `nodes` transport's bounds
                    print(f"{'':>11} | {'':>11} | {'  nodes: dropped':>11} {100 * result['nodes_dropped']:.3f}%")
            print(f"{'':>11}   ({time.perf_counter() - started:.0f} s)", flush=True)
    print("skew: expert load max/mean over the group / each source's top-`hot` experts over its mean per expert.")
    print(
        "plan kernels (online rows): kernel launches of the per-dispatch replica plan (plan_from_load) / of the "
        "greedy it replaced (greedy_plan_from_load, now the step placement's planner) on the same loads."
    )
    print(
        f"over cap: {args.old_revision} = largest (source, destination) pair minus C_pair (> 0: drops); "
        f"{args.previous_revision} = largest planned destination minus C_dest (> 0: drops); new relay = largest "
        "pair minus its hop-1 rows (the excess is relayed through other ranks; drops only past hop 2's "
        "bound). cap: C_pair, C_dest, or hop-1 + hop-2 rows per pair."
    )
    print(
        f"token bytes: {args.previous_revision} splits reads split sizes on the host (a device sync per "
        "dispatch); padded and relay are fixed shapes with nothing read on the host."
    )


if __name__ == "__main__":
    main()
