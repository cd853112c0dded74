"""Expert parallelism at K3 scale, in one process: drops and wire bytes for R = 8 … 256 ranks.

Runs the real planner, slot routing and drop rules (`parallel/expert_plan.py`) for every
simulated source rank, on synthetic routing with K3's shapes (896 experts, top-16, latent 3584,
expert width 3072, 2,048 tokens per rank and micro-batch, at most 2 replicas per rank), and the
same for the code of an earlier revision (`--old-revision`, loaded from git into a temporary
module) side by side.

Routing regimes (each source's logits `noise + global bias + its own bias`, top-k):
* `global`: every expert has a fixed bias `N(0, global_skew)` (some experts hot everywhere);
* `per_source`: the global bias, plus each source's own `hot` experts boosted by `boost`
  (documents with their own topics): the skew the (source, destination) pairs see.

Replicas: the new code plans the step's placement from the previous step's loads (a second draw
of the same regime) and routes the measured step within it; the old code plans per micro-batch.

Bytes per rank and step (`--micro-batches` micro-batches, bf16 rows, int32 ids), what the
busiest rank sends: tokens = dispatch + combine, forward + backward; replicas = weights forward
+ gradients backward. "min" is the unpadded minimum (every slot's row once each way). The new
token bytes are those of the exact-split transport (`splits`, or a device-split all-to-all);
the padded gloo reference sends `R·s·k` rows per micro-batch instead.

    python benchmarks/ep_scale.py                      # R = 8, 64, 256, both regimes, old and new
    python benchmarks/ep_scale.py --ranks 64 --regimes per_source
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from k3train.parallel.expert_plan import (  # noqa: E402
    ReplicaPlacement, apply_placement, capacity_per_destination, capacity_per_pair, destination_room, pack_slots,
    pair_slots, plan_from_load, replica_route,
)


def load_old_module(revision: str):
    """`parallel/expert.py` as it was at `revision`, imported as a temporary module."""
    source = subprocess.run(["git", "show", f"{revision}:parallel/expert.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "expert_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("expert_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["expert_old"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def routing(args, ranks: int, regime: str, step: int):
    """Per source: expert ids `[R, s, k]`, weights, and counts `[R, E]`; the biases are fixed per
    regime (seeded by R), the noise differs per step."""
    experts, tokens, top_k = args.experts, args.tokens, args.top_k
    biases = torch.Generator().manual_seed(1000 + ranks)
    global_bias = torch.randn(experts, generator=biases) * args.global_skew
    own_hot = [torch.randperm(experts, generator=biases)[:args.hot] for _ in range(ranks)]
    noise = torch.Generator().manual_seed(10 * ranks + step)
    ids = torch.empty(ranks, tokens, top_k, dtype=torch.int64)
    weights = torch.empty(ranks, tokens, top_k)
    for source in range(ranks):
        logits = torch.randn(tokens, experts, generator=noise) + global_bias
        if regime == "per_source":
            logits[:, own_hot[source]] += args.boost
        top, index = logits.sigmoid().topk(top_k, dim=-1)
        ids[source], weights[source] = index, top / top.sum(-1, keepdim=True)
    counts = torch.zeros(ranks, experts, dtype=torch.int64)
    for source in range(ranks):
        counts[source].index_add_(0, ids[source].flatten(), torch.ones(tokens * top_k, dtype=torch.int64))
    return ids, weights, counts


def new_code(args, ranks, ids, weights, counts, previous_load):
    slots = args.tokens * args.top_k
    capacity = capacity_per_destination(args.tokens, args.top_k, ranks, args.capacity_factor)
    plan0 = plan_from_load(previous_load, ranks, args.max_replicas, args.tolerance)
    placement = ReplicaPlacement.from_plan(plan0)
    if not args.no_spares:
        placement = placement.with_spares(previous_load, plan0.rank_load, args.max_replicas)
    plan = apply_placement(counts, placement, capacity)
    room = destination_room(pair_slots(counts, plan), capacity)
    dropped = 0
    for source in range(ranks):
        dest, _ = replica_route(ids[source].flatten(), counts, source, plan)
        _, keep = pack_slots(dest, weights[source].flatten(), ranks, room[source])
        dropped += int((~keep).sum())
    sent, returned = room.sum(1), room.sum(0)  # rows each rank sends, and returns (as destination)
    token_rows = int((2 * (sent + returned)).max())  # forward + backward, busiest rank
    outgoing = torch.zeros(ranks, dtype=torch.int64)
    local = args.experts // ranks
    for expert, dest, _ in placement.host:
        outgoing[expert // local] += 1  # the home sends the weights
        outgoing[dest] += 1  # the holder sends the gradients back
    return {"dropped": dropped / (ranks * slots), "over": int((plan.rank_load - capacity).max()),
            "capacity": capacity, "token_rows": token_rows, "token_ids": int(sent.max()),
            "replica_matrices_step": int(outgoing.max()), "replicas": placement.num_replicas}


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
    return {"dropped": dropped / (ranks * slots), "over": largest - capacity, "capacity": capacity,
            "token_rows": 4 * ranks * capacity, "token_ids": ranks * capacity,
            "replica_matrices_micro_batch": 2 * ranks * args.max_replicas, "replicas": int(plan.num_replicas)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="*", default=[8, 64, 256])
    parser.add_argument("--regimes", nargs="*", default=["global", "per_source"])
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank and micro-batch")
    parser.add_argument("--latent", type=int, default=3584)
    parser.add_argument("--inner", type=int, default=3072)
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--tolerance", type=float, default=0.05, help="planner: relieve ranks above (1+t)·mean")
    parser.add_argument("--no-spares", action="store_true", help="do not fill free replica slots")
    parser.add_argument("--micro-batches", type=int, default=16,
                        help="micro-batches per step (recipes/k3.yaml: 16.8M tokens over 512 routing ranks "
                             "= 32K tokens per rank and step = 16 micro-batches of 2048)")
    parser.add_argument("--global-skew", type=float, default=0.1)
    parser.add_argument("--hot", type=int, default=8, help="per_source: each source's own hot experts")
    parser.add_argument("--boost", type=float, default=0.8, help="per_source: logit boost of the own hot experts")
    parser.add_argument("--old-revision", default="222b10e", help="git revision of 'today's code'; '' to skip")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    old = load_old_module(args.old_revision) if args.old_revision else None
    element, micro = 2, args.micro_batches
    matrix = 3 * args.inner * args.latent * element
    minimum = 4 * args.tokens * args.top_k * args.latent * element * micro  # bytes/rank/step, unpadded
    print(f"K3 shapes: {args.experts} experts, top-{args.top_k}, latent {args.latent}, I {args.inner}, "
          f"{args.tokens} tokens/rank/micro-batch, {micro} micro-batches/step, max {args.max_replicas} replicas/rank, "
          f"capacity_factor {args.capacity_factor}; bytes per rank per step (busiest rank), bf16; "
          f"token minimum {minimum / 2**30:.2f} GiB")
    header = ("R", "routing", "code", "skew", "dropped", "over cap", "cap", "replicas", "token GiB", "×min",
              "replica GiB", "replica/token")
    print(" | ".join(f"{h:>11}" for h in header))
    for ranks in args.ranks:
        for regime in args.regimes:
            started = time.perf_counter()
            _, _, previous = routing(args, ranks, regime, step=0)
            ids, weights, counts = routing(args, ranks, regime, step=1)
            mean = args.tokens * args.top_k / args.experts
            load = counts.sum(0).double()
            skew = f"{(load.max() / load.mean()).item():.1f}/{(counts.double().topk(args.hot, dim=1).values.mean() / mean).item():.1f}"
            rows = [("new", new_code(args, ranks, ids, weights, counts, previous.sum(0)))]
            if old is not None:
                rows.insert(0, ("today", old_code(args, old, ranks, ids, weights, counts)))
            for label, result in rows:
                token_bytes = (result["token_rows"] * args.latent * element + result["token_ids"] * 4) * micro
                if label == "new":
                    replica_bytes = result["replica_matrices_step"] * matrix
                else:
                    replica_bytes = result["replica_matrices_micro_batch"] * matrix * micro
                cells = (ranks, regime, label, skew, f"{100 * result['dropped']:.3f}%", result["over"],
                         result["capacity"], result["replicas"], f"{token_bytes / 2**30:.2f}",
                         f"{token_bytes / minimum:.3f}", f"{replica_bytes / 2**30:.3f}",
                         f"{100 * replica_bytes / token_bytes:.1f}%")
                print(" | ".join(f"{str(c):>11}" for c in cells))
            print(f"{'':>11}   ({time.perf_counter() - started:.0f} s)", flush=True)
    print("skew: expert load max/mean over the group / each source's top-`hot` experts over its mean per expert.")
    print("over cap: today = largest (source, destination) pair minus C_pair; new = largest destination "
          "minus C_dest (planned); > 0 means drops. new token bytes: exact-split transport.")


if __name__ == "__main__":
    main()
