"""Expert-parallel dispatch and routing balance, as tables.

(a) Dispatch + combine bytes per token in the latent width against the full width. The real
    dispatch code (`k3train.parallel.expert.ExpertParallel`, K3 dimensions) runs on the `meta`
    device through a loopback group whose collectives are counted by `comm.TrafficCounter`:
    since every buffer shape is a function of the config and micro-batch size alone, the counted
    bytes are exactly what each EP rank sends, whatever the routing.
(b) Router scores that drift over steps (896 experts, top-16): the max/mean expert load per step
    when the bias comes from `quantile`, `quantile_histogram`, `sign` or `none`
    (`k3train/model/balance.py`, bias from step t used at step t+1), plus a non-causal floor (the
    exact quantile bias of the same batch).
(c) The histogram quantile against the exact one for 100, 1000 and 10000 bins.
(d) Dropped slots of the fixed-size dispatch (EP 16, K3 routing from (b)) in `capacity` and
    `balanced` mode at several capacity factors, routed by the real planner and drop policy.
(e) The routed experts' GLU, forward + backward on sorted rows, on CPU: `grouped_mm` (the
    training path), the plain per-group loop under autograd (`grouped_mm_reference`, the path
    before the custom backward), `torch._grouped_mm` where torch runs it on CPU, against the same
    GLU as dense matmuls of the same FLOPs (all rows through one expert's matrices). Timed in
    alternation in one process, medians of this process's CPU time (`time.process_time`, which a
    loaded machine disturbs far less than wall-clock time).

    OMP_NUM_THREADS=1 python benchmarks/moe.py                  # all tables, ~1-2 min on one core
    OMP_NUM_THREADS=1 python benchmarks/moe.py --tables a c     # some of them
    OMP_NUM_THREADS=1 nice python benchmarks/moe.py --tables e --repeats 9
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time

import torch

from k3train.kernels.grouped_gemm import grouped_mm, grouped_mm_reference
from k3train.model.balance import (
    Balancer,
    ExactQuantileBalancer,
    HistogramQuantileBalancer,
    SignBalancer,
    histogram_quantile,
    kth_largest_cutoff,
)
from k3train.model.config import ModelConfig
from k3train.model.moe import GroupedExperts
from k3train.parallel.comm import Group, TrafficCounter
from k3train.parallel.expert import ExpertParallel, Mode
from k3train.parallel.expert_plan import (
    capacity_per_destination,
    capacity_per_pair,
    destination_room,
    home_route,
    pack_slots,
    pair_slots,
    plan_replicas,
    replica_route,
)


def table(headers: list[str], rows: list[list], title: str) -> None:
    cells = [[str(h) for h in headers]] + [
        [c if isinstance(c, str) else f"{c:.4g}" if isinstance(c, float) else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for index, row in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
        if index == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


# ---------------------------------------------------------------------------------------------- (a)
class LoopbackGroup(Group):
    """Counts collectives like a group of `size` ranks; the data just comes back (shapes only)."""

    def all_to_all(self, tensor):
        self.counter.add(self.name, tensor)
        return tensor.clone()

    def all_gather(self, tensor, dim=0):
        self.counter.add(self.name, tensor)
        return torch.cat([tensor] * self.size, dim=dim)

    def all_to_all_uneven(self, tensor, send, receive, label=None):
        self.counter.add(label or self.name, tensor)
        return tensor.new_zeros(sum(receive), *tensor.shape[1:])


def meta_experts(config: ModelConfig, count: int, latent: int, dtype) -> GroupedExperts:
    """The model's own experts module on the meta device, in the latent width `latent`."""
    with torch.device("meta"):
        return GroupedExperts(dataclasses.replace(config, routed_expert_hidden_size=latent), count).to(dtype)


def dispatch_bytes(
    config: ModelConfig,
    width: int,
    ep: int,
    tokens: int,
    mode: Mode,
    capacity_factor: float,
    max_replicas: int,
    dtype=torch.bfloat16,
) -> dict[str, int]:
    """Bytes one EP rank sends per micro-batch and MoE layer, forward + backward, by buffer."""
    counter = TrafficCounter()
    group = LoopbackGroup("ep", tuple(range(ep)), 0, None, counter)
    expert_parallel = ExpertParallel(group, config.num_experts, mode, capacity_factor, max_replicas, compute="gather")
    experts = meta_experts(config, expert_parallel.num_local_experts, width, dtype)
    k = config.num_experts_per_token
    latent = torch.empty(tokens, width, device="meta", dtype=dtype, requires_grad=True)
    ids = torch.empty(tokens, k, device="meta", dtype=torch.int64)
    weights = torch.empty(tokens, k, device="meta", dtype=torch.float32, requires_grad=True)
    recorded: list[tuple[tuple[int, ...], torch.dtype, int]] = []
    original_add = counter.add

    def add(group_name: str, tensor: torch.Tensor, operation: str = "all_reduce") -> None:
        recorded.append((tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size()))
        original_add(group_name, tensor, operation)

    counter.add = add  # type: ignore[method-assign]  # this one counter records each send, on purpose
    routed, _ = expert_parallel(latent, ids, weights, experts)
    routed.sum().backward()
    capacity = expert_parallel.capacity(tokens, k)
    shapes = expert_parallel.buffer_shapes(tokens, k, width, config.moe_intermediate_size)
    kind_of = {shapes["dispatch"]: "tokens", shapes["dispatch_ids"]: "ids"}
    if "slot_counts" in shapes:
        kind_of[shapes["slot_counts"]] = "slot counts"
    kinds = {"tokens": 0, "ids": 0, "slot counts": 0, "replica weights": 0}
    for shape, _dtype, nbytes in recorded:
        kinds[kind_of.get(shape, "replica weights")] += nbytes
    kinds["capacity"] = capacity
    return kinds


def table_a(args) -> None:
    config = ModelConfig.preset("k3")
    d, latent, k = config.hidden_size, config.routed_expert_hidden_size, config.num_experts_per_token
    assert latent is not None, "the k3 preset has a latent width"
    rows = []
    modes: tuple[Mode, ...] = ("capacity", "balanced")
    for mode in modes:
        for width, label in ((latent, f"latent {latent}"), (d, f"full {d}")):
            counted = dispatch_bytes(config, width, args.ep, args.tokens, mode, args.capacity_factor, args.max_replicas)
            per_token = {key: value / args.tokens for key, value in counted.items() if key != "capacity"}
            rows.append(
                [
                    mode,
                    label,
                    counted["capacity"],
                    per_token["tokens"],
                    per_token["ids"],
                    per_token["slot counts"],
                    per_token["replica weights"],
                    per_token["tokens"] + per_token["ids"] + per_token["slot counts"],
                ]
            )
    for index in range(0, len(rows), 2):
        latent_row, full_row = rows[index], rows[index + 1]
        ratio_tokens = latent_row[3] / full_row[3]
        ratio_all = latent_row[7] / full_row[7]
        latent_row.append(f"{ratio_tokens:.4f} / {ratio_all:.4f}")
        full_row.append("1 / 1")
    ideal = 4 * k * args.capacity_factor * latent * 2  # 4 all-to-alls (fwd dispatch+combine, bwd both), bf16
    table(
        [
            "mode",
            "width",
            "C_pair",
            "token bufs B/tok",
            "ids B/tok",
            "slot counts B/tok",
            "replica weights B/tok",
            "dispatch+combine B/tok",
            "latent/full (tokens / all)",
        ],
        rows,
        f"(a) bytes one EP rank sends per token and MoE layer, forward + backward: K3 (d={d}, l={latent}, k={k}, "
        f"E={config.num_experts}), ep={args.ep}, s={args.tokens} tokens/rank, "
        f"capacity_factor={args.capacity_factor}, "
        f"bf16; counted through the dispatch code on the meta device. Formula for the token buffers: "
        f"4·k·cf·l·2 B = {ideal:.0f} B/token (latent).",
    )
    print(
        "  Balanced mode with the default `padded` transport (the gloo reference with static shapes) sends every "
        "(source, destination) pair at s·k rows, ep× the token bytes; `transport=splits` sends only the rows that "
        "exist (1.02-1.04× the minimum, benchmarks/ep_scale.py). Replica weights move once per step "
        "(`ExpertParallel.step_replicas`), not per micro-batch: the column above is the fetch counted in this one call."
    )


# ---------------------------------------------------------------------------------------------- (b)
class DriftingRouter:
    """Sigmoid scores for `experts` experts: a static popularity, a slow per-expert sinusoidal
    drift, token topics (low rank) and noise."""

    def __init__(self, experts: int, topics: int = 16, seed: int = 0, drift: float = 0.5, period: float = 100.0):
        generator = torch.Generator().manual_seed(seed)
        self.generator = generator
        self.popularity = torch.randn(experts, generator=generator) * 0.6
        self.phase = torch.rand(experts, generator=generator) * 2 * math.pi
        self.affinity = torch.randn(topics, experts, generator=generator) * 0.8
        self.topics, self.drift, self.period = topics, drift, period

    def scores(self, step: int, tokens: int) -> torch.Tensor:
        generator = self.generator
        mean = self.popularity + self.drift * torch.sin(2 * math.pi * step / self.period + self.phase)
        topic = torch.randint(0, self.topics, (tokens,), generator=generator)
        noise = torch.randn(tokens, mean.shape[0], generator=generator)
        return torch.sigmoid(mean + self.affinity[topic] + noise - 2.0)


def table_b(args) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    experts, k = 896, 16
    router = DriftingRouter(experts, seed=1)
    balancers = {
        "none": Balancer(),
        "sign (rate 1e-3)": SignBalancer(experts, k, rate=1e-3),
        "sign (rate 1e-2)": SignBalancer(experts, k, rate=1e-2),
        "quantile": ExactQuantileBalancer(experts, k),
        "quantile_histogram": HistogramQuantileBalancer(experts, k, 1000),
        "same-batch floor": None,
    }
    biases = {name: torch.zeros(experts) for name in balancers}
    history: dict[str, list[float]] = {name: [] for name in balancers}
    kept_scores, kept_biases = [], []
    started = time.perf_counter()
    for step in range(args.steps):
        scores = router.scores(step, args.router_tokens)
        for name, balancer in balancers.items():
            if balancer is None:  # non-causal: the exact quantile bias of this very batch
                exact = ExactQuantileBalancer(experts, k)
                exact.observe(scores, torch.zeros(experts))
                bias = exact.next_bias(torch.zeros(experts))
            else:
                bias = biases[name]
            chosen = (scores + bias).topk(k, dim=-1).indices.flatten()
            load = torch.zeros(experts).index_add_(0, chosen, torch.ones(chosen.shape[0]))
            history[name].append((load.max() / load.mean()).item())
            if balancer is not None:
                balancer.observe(scores, bias)
                biases[name] = balancer.next_bias(bias)
        if step in (0, args.steps // 2):
            kept_scores.append(scores)
            kept_biases.append(biases["quantile"].clone())
    marks = [s for s in (1, 2, 3, 5, 10, 20, 50, 100, 200) if s <= args.steps]
    rows = []
    for name, values in history.items():
        tail = values[min(10, len(values) - 1) :]
        rows.append([name] + [values[m - 1] for m in marks] + [sum(tail) / len(tail), max(tail)])
    q = args.router_tokens * k / experts
    table(
        ["balancer"] + [f"step {m}" for m in marks] + ["mean steps>10", "max steps>10"],
        rows,
        f"(b) max/mean expert load per step: 896 experts, top-16, {args.router_tokens} tokens/step "
        f"(q = {q:.0f} slots/expert), scores drifting with period {router.period:.0f} steps; bias from step t "
        f"applied at t+1 ({time.perf_counter() - started:.0f} s)",
    )
    return kept_scores, kept_biases


# ---------------------------------------------------------------------------------------------- (c)
def table_c(args, scores_list=None, biases=None) -> None:
    experts, k = 896, 16
    if scores_list is None:
        router = DriftingRouter(experts, seed=1)
        scores_list = [router.scores(0, args.router_tokens), router.scores(20, args.router_tokens)]
        biases = [torch.zeros(experts), torch.randn(experts) * 0.05]
    rows = []
    for case, (scores, bias) in enumerate(zip(scores_list, biases)):
        margins = (kth_largest_cutoff(scores, bias, k)[:, None] - scores).double()
        exact = torch.quantile(margins, k / experts, dim=0)  # ExactQuantileBalancer's convention
        exact_bias = exact - exact.mean()
        rank = math.ceil(margins.shape[0] * k / experts)  # the sample the histogram's cdf crosses at
        inverse_cdf = margins.kthvalue(rank, dim=0).values
        for bins in (100, 1000, 10000):
            balancer = HistogramQuantileBalancer(experts, k, bins)
            balancer.observe(scores, bias)
            low, high = HistogramQuantileBalancer.margin_range(bias)
            assert balancer.counts is not None, "observe() counted this batch"
            raw = histogram_quantile(balancer.counts, k / experts, low, high)
            new_bias = balancer.next_bias(bias).double()
            width = (high - low).item() / bins
            error = (raw - exact).abs()
            cdf_error = (raw - inverse_cdf).abs()
            chosen = (scores + new_bias.float()).topk(k, -1).indices.flatten()
            load = torch.bincount(chosen, minlength=experts).double()
            chosen_exact = (scores + exact_bias.float()).topk(k, -1).indices.flatten()
            load_exact = torch.bincount(chosen_exact, minlength=experts).double()
            rows.append(
                [
                    f"batch {case + 1}",
                    bins,
                    width,
                    cdf_error.max().item() / width,
                    error.max().item(),
                    error.mean().item(),
                    error.max().item() / width,
                    (new_bias - exact_bias).abs().max().item(),
                    (load.max() / load.mean()).item(),
                    (load_exact.max() / load_exact.mean()).item(),
                    bins * experts * 8,
                ]
            )
    table(
        [
            "margins",
            "bins",
            "bin width",
            "max err vs inverse cdf / bin",
            "max |err| vs torch.quantile",
            "mean |err|",
            "max err / bin",
            "max bias diff",
            "max/mean load (hist bias)",
            "max/mean load (exact bias)",
            "all-reduce bytes (int64)",
        ],
        rows,
        f"(c) histogram quantile vs exact (torch.quantile) per expert, 896 experts, top-16, "
        f"{args.router_tokens} tokens; 'inverse cdf' is the ceil(m·k/n)-th smallest margin, the sample the "
        f"histogram's cumulative counts cross at (bounded by one bin); torch.quantile interpolates between neighbouring samples, "
        f"whose gaps in the sparse tail exceed a bin at 10000 bins; loads: the same batch routed with each bias",
    )


# ---------------------------------------------------------------------------------------------- (d)
def table_d(args) -> None:
    experts, k, ep, replicas = 896, 16, args.ep, args.max_replicas
    tokens = args.dispatch_tokens
    router = DriftingRouter(experts, seed=2)
    balancer = ExactQuantileBalancer(experts, k)
    bias = torch.zeros(experts)
    cases = {}
    for step in range(12):  # warm the quantile bias up on the drifting router
        scores = router.scores(step, ep * tokens)
        if step == 0:
            cases["none (step 1)"] = (scores, torch.zeros(experts))
        balancer.observe(scores, bias)
        bias = balancer.next_bias(bias)
    cases["quantile (step 13)"] = (router.scores(12, ep * tokens), bias)
    rows = []
    for label, (scores, case_bias) in cases.items():
        ids = (scores + case_bias).topk(k, dim=-1).indices
        weights = scores.gather(-1, ids)
        ids, weights = ids.view(ep, tokens, k), weights.view(ep, tokens, k)
        counts = torch.zeros(ep, experts, dtype=torch.int64)
        for source in range(ep):
            counts[source].index_add_(0, ids[source].flatten(), torch.ones(tokens * k, dtype=torch.int64))
        plan = plan_replicas(counts, replicas)
        rank_load = counts.sum(0).view(ep, -1).sum(1).double()
        for factor in args.capacity_factors:
            capacity = capacity_per_pair(tokens, k, ep, factor)
            room = destination_room(pair_slots(counts, plan), capacity_per_destination(tokens, k, ep, factor))
            dropped = {"capacity": 0, "balanced": 0}
            for source in range(ep):
                flat, w = ids[source].flatten(), weights[source].flatten()
                dest = home_route(flat, experts // ep)[0]
                dropped["capacity"] += int((~pack_slots(dest, w, ep, capacity)[1]).sum())
                dest = replica_route(flat, counts, source, plan)[0]  # per-destination receive capacity
                dropped["balanced"] += int((~pack_slots(dest, w, ep, room[source])[1]).sum())
            total = ep * tokens * k
            rows.append(
                [
                    label,
                    factor,
                    capacity,
                    (rank_load.max() / rank_load.mean()).item(),
                    (plan.rank_load.max().double() / plan.rank_load.double().mean()).item(),
                    int(plan.num_replicas),
                    dropped["capacity"] / total,
                    dropped["balanced"] / total,
                ]
            )
    table(
        [
            "routing",
            "capacity_factor",
            "C_pair",
            "rank load max/mean (home)",
            "planned max/mean",
            "replicas",
            "dropped (capacity)",
            "dropped (balanced)",
        ],
        rows,
        f"(d) dropped slots of the fixed-size dispatch: 896 experts, top-16, ep={ep}, {tokens} tokens/rank, "
        f"max_replicas_per_rank={replicas}; real planner and drop policy",
    )


# ---------------------------------------------------------------------------------------------- (e)
def expert_glu_pass(rows, stacks, group_ends, activation, mm) -> float:
    """Seconds for `w2 · act(w1 x, w3 x)` forward + backward with the grouped GEMM `mm`
    (as `GroupedExperts.forward_sorted`)."""
    w1, w3, w2 = stacks
    start = time.process_time()
    gate = mm(rows, w1.transpose(1, 2), group_ends)
    up = mm(rows, w3.transpose(1, 2), group_ends)
    out = mm(activation(gate, up), w2.transpose(1, 2), group_ends)
    out.backward(torch.ones_like(out))
    elapsed = time.process_time() - start
    for tensor in (rows, *stacks):
        tensor.grad = None
    return elapsed


def torch_grouped_mm(x, weights, group_ends):
    return torch._grouped_mm(x, weights, offs=group_ends)


def dense_mm(x, weights, group_ends):
    """All rows through one matrix (`weights` holds one group): the FLOPs of the grouped GLU as
    dense matmuls."""
    return x @ weights[0]


def table_e(args: argparse.Namespace) -> None:
    rows_out = []
    for label, tokens, width, inner in (("debug", 256, 64, 64), ("wide512", 1024, 256, 256)):
        config = dataclasses.replace(
            ModelConfig(),
            routed_expert_hidden_size=width,
            moe_intermediate_size=inner,
            num_experts=args.glu_experts,
            num_experts_per_token=args.glu_top_k,
        )
        experts = GroupedExperts(config, args.glu_experts)
        generator = torch.Generator().manual_seed(0)
        stacks = [torch.randn(p.shape, generator=generator).mul_(0.05).requires_grad_() for p in experts.stacks()]
        ids = torch.rand(tokens, args.glu_experts, generator=generator).topk(args.glu_top_k, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=args.glu_experts)
        group_ends = counts.cumsum(0).to(torch.int32)
        rows = torch.randn(int(counts.sum()), width, generator=generator, requires_grad=True)
        kernels = {"dense": dense_mm, "grouped_mm": grouped_mm, "loop (before)": grouped_mm_reference}
        if hasattr(torch, "_grouped_mm"):
            kernels["torch._grouped_mm"] = torch_grouped_mm
        dense_stacks = [stack[:1].detach().clone().requires_grad_() for stack in stacks]  # one expert's matrices
        times: dict[str, list[float]] = {name: [] for name in kernels}

        def run(name: str) -> float:
            return expert_glu_pass(
                rows, dense_stacks if name == "dense" else stacks, group_ends, experts.activation, kernels[name]
            )

        for name in kernels:  # warm-up
            run(name)
        for _ in range(args.repeats):
            for name in kernels:
                times[name].append(run(name))
        medians = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        rows_out.append(
            [f"{label}: {rows.shape[0]} rows, {width}->{inner}->{width}"]
            + [f"{medians[name]:.2f} ({medians[name] / medians['dense']:.2f}x)" for name in kernels]
        )
    table(
        ["case", *[f"{name} ms (/dense)" for name in kernels]],
        rows_out,
        f"(e) expert GLU forward+backward, {args.glu_experts} experts top-{args.glu_top_k}, fp32, "
        f"{torch.get_num_threads()} thread(s), median of {args.repeats}",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", nargs="*", default=["a", "b", "c", "d"])
    parser.add_argument("--ep", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4096, help="(a) tokens per rank and micro-batch")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="(b) steps of the drifting router")
    parser.add_argument("--router-tokens", type=int, default=4096, help="(b, c) tokens per step")
    parser.add_argument("--dispatch-tokens", type=int, default=1024, help="(d) tokens per rank")
    parser.add_argument("--capacity-factors", type=float, nargs="*", default=[1.0, 1.25, 1.5])
    parser.add_argument("--glu-experts", type=int, default=16, help="(e) experts")
    parser.add_argument("--glu-top-k", type=int, default=4, help="(e) experts per token")
    parser.add_argument("--repeats", type=int, default=9, help="(e) timed passes per kernel")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kept: tuple[list[torch.Tensor], list[torch.Tensor]] | tuple[None, None] = (None, None)
    if "a" in args.tables:
        table_a(args)
    if "b" in args.tables:
        kept = table_b(args)
    if "c" in args.tables:
        table_c(args, *kept)
    if "d" in args.tables:
        table_d(args)
    if "e" in args.tables:
        table_e(args)


if __name__ == "__main__":
    main()
