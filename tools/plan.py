#!/usr/bin/env python
"""Plan a run without hardware: check a recipe's parallel layout and print, per pipeline rank,
the layers, parameters and memory (weights, gradients, optimizer state, activations, AttnRes
cache, EP buffers), the bytes per process group of one step, and with --hardware the step time,
tokens/s and MFU; a "fits:" or "does not fit:" line compares the fullest rank with the limit
that --search uses; --search lists the fastest layouts of a world size that fit (a progress bar
on a terminal's stderr; --budget SECONDS stops it and says how many layouts it left out);
--validate runs small layouts on gloo with an emulated network and prints the planner's terms
beside the measured ones (k3train/planning/validate.py).

    python tools/plan.py --recipe recipes/k3.yaml --world-size 1024 --hardware h200
    python tools/plan.py --recipe recipes/k3.yaml --world-size 4096 --hardware b200 --search
    python tools/plan.py --recipe recipes/debug.yaml --world-size 4 parallel.tp=2 parallel.dp=2
    python tools/plan.py --validate

Every rank's model is built on the meta device through the same code the job uses (TP shards,
EP experts, pipeline chunks, ZeRO-1 owners), so parameter counts and optimizer state are exact;
the activation, time and search models are described in docs/planning.md.
"""

from __future__ import annotations

import argparse
import sys

import torch

from k3train.config import ConfigError, load_config
from k3train.model.flops import documents_of_length, parameter_counts, training_flops_per_token
from k3train.model.k3 import K3RankModel
from k3train.optim.builder import route_parameters
from k3train.parallel.expert import ExpertParallel
from k3train.parallel.pipeline_schedule import PipelineConfigError, PipelinePlan
from k3train.parallel.state import LayoutError, layout_of
from k3train.planning.fit import memory_verdict
from k3train.planning.hardware import load_profile
from k3train.planning.layout_traffic import (
    DATA_PARALLEL_GROUPS,
    data_parallel_wire_bytes,
    gradient_bucket_schedule,
    layout_step_bytes,
    overlapped_tensor_regions,
)
from k3train.planning.memory import GIB as _GIB
from k3train.planning.memory import MEMORY_HEADER, rank_memory
from k3train.planning.search import LayoutSearch, SearchOutcome, describe_candidates
from k3train.planning.search_budget import SearchBudget
from k3train.planning.time import estimate_step_time
from k3train.planning.traffic import predicted_job_traffic
from k3train.planning.validate import (
    VALIDATION_LAYOUTS,
    ValidationSettings,
    compare,
    default_max_ranks,
    format_rows,
    launch,
    summary,
    world_size_of,
)
from k3train.training.build import build_model, build_planning_rank, planning_parallel_state

GIB = 2**30
EXIT_STATUS = """exit status: 0 when a plan or a list of layouts was computed, whether or not the plan's
layout fits (its "fits:" / "does not fit:" line says which); 1 when --search finds no layout of
the world size that fits (the nearest sizes that have one are listed); 2 for a usage error or a
layout the recipe refuses."""
DATA_GROUPS = DATA_PARALLEL_GROUPS
"""The groups whose step time uses ring wire bytes (gradient buckets and the ZeRO-1 exchange)."""


def rank_stage(config, layout, pp_rank: int, plan: PipelinePlan) -> K3RankModel:
    """Pipeline rank `pp_rank`'s model (its tp/dp/ep rank 0), on the meta device."""
    state = planning_parallel_state(layout, layout.rank_of(0, 0, pp_rank), config.parallel.sequence_parallel)
    expert_parallel = ExpertParallel.from_state(state, config.parallel, config.model.num_experts)
    return build_model(config.model, plan, state, expert_parallel, device=torch.device("meta"))


def memory_estimate(stage: K3RankModel, config, shards: int) -> tuple[int, float]:
    """(parameters on this rank, GiB of weights + gradients + fp32 masters + optimizer state,
    before the bucket buffers: a quick estimate; the table after it counts what the job allocates)."""
    parameters = sum(p.numel() for p in stage.parameters())
    state_elements: float = 0
    for route in route_parameters(stage, config.optimizer):
        state_elements += route.param.numel() * (1 if route.route == "muon" else 2)
    masters: float = parameters if config.train.weights == "bf16_with_fp32_master_shards" else 0
    if config.parallel.zero1:
        # owners spread over the smallest replica group (the search's bound; experts replicate
        # over expert_dp only)
        state_elements /= shards
        masters /= shards
    weight = 2 if masters else 4
    gradient = 2 if config.train.grad_dtype == "bf16" else 4
    return parameters, (parameters * (weight + gradient) + (masters + state_elements) * 4) / GIB


def search_hint(args, world: int) -> str:
    """The command that lists this world size's layouts that fit (the same recipe and options)."""
    words = [
        "python tools/plan.py --recipe",
        args.recipe,
        "--world-size",
        str(world),
        "--hardware",
        args.hardware or "h200",
        "--search",
    ]
    if args.memory_limit is not None:
        words += ["--memory-limit", f"{args.memory_limit:g}"]
    if args.gpus_per_node:
        words += ["--gpus-per-node", str(args.gpus_per_node)]
    return "to list the layouts of this world size that fit: " + " ".join(words + list(args.overrides))


def budget_note(outcome: SearchOutcome, budget: SearchBudget) -> str:
    """What `--budget` left out of one world size's search."""
    if not outcome.evaluated:
        return (
            f"search stopped by --budget {budget.seconds:g} s before any of the {outcome.layouts:,} layouts "
            f"of world {outcome.world_size} was evaluated"
        )
    return (
        f"search stopped by --budget {budget.seconds:g} s: {outcome.unevaluated:,} of {outcome.layouts:,} "
        f"layouts of world {outcome.world_size} not evaluated (the list is the best of the "
        f"{outcome.evaluated:,} evaluated)"
    )


def search(args) -> int:
    """`--search`: the best layouts of `--world-size`, or the nearest world sizes that have one.
    0: a list was printed; 1: no layout of the world size fits (or none among the layouts the
    budget allowed); 2: usage error."""
    if not args.world_size:
        print("error: --search needs --world-size", file=sys.stderr)
        return 2
    hardware = load_profile(args.hardware or "h200")
    # The bar goes to a terminal only: a log or a test's pipe would get a line per refresh.
    budget = SearchBudget(args.budget, show_progress=sys.stderr.isatty())
    searcher = LayoutSearch(
        args.recipe,
        hardware,
        memory_limit_gib=args.memory_limit,
        gpus_per_node=args.gpus_per_node,
        efficiency=args.efficiency,
        overrides=args.overrides,
        budget=budget,
    )
    outcome = searcher.run(args.world_size, top=args.top)
    if outcome.candidates:
        print(
            f"fastest layouts of {args.world_size} {hardware.name} GPUs that fit (predicted, "
            f"{args.efficiency:.0%} of the dense peak):"
        )
        print(describe_candidates(list(outcome.candidates)))
        if outcome.out_of_budget:
            print(budget_note(outcome, budget))
        print("\nrun the first with: " + " ".join(outcome.candidates[0].overrides()))
        return 0
    if outcome.out_of_budget:
        print(
            f"no fitting layout of {args.world_size} GPUs found; "
            + budget_note(outcome, budget)
            + "; nearest world sizes not searched"
        )
        return 1
    nearest = searcher.nearest_fitting_world_sizes(args.world_size, step=args.gpus_per_node or hardware.gpus_per_node)
    print(
        f"no layout of {args.world_size} GPUs fits; nearest world sizes with one: "
        + (", ".join(map(str, nearest.sizes)) or "none found")
        + (f" (search stopped by --budget {budget.seconds:g} s before two were found)" if nearest.out_of_budget else "")
    )
    for size in nearest.sizes:
        print(f"\nworld size {size}:")
        found = searcher.run(size, top=args.top)
        if found.candidates:
            print(describe_candidates(list(found.candidates)))
        if found.out_of_budget:
            print(budget_note(found, budget))
    return 1


def validate(args) -> int:
    """`--validate`: the planner's terms against gloo runs (`k3train/planning/validate.py`).
    0: every exposed-seconds term within the bound and every byte and message count equal;
    1: some are not (the table says which); 2: usage error or a failed launch."""
    try:
        bandwidth, latency = (float(part) for part in args.validate_link.split(","))
    except ValueError:
        print(
            f"error: --validate-link must be GBPS,LATENCY_US (e.g. 0.05,100), got {args.validate_link!r}",
            file=sys.stderr,
        )
        return 2
    if args.overrides:
        print("error: --validate runs its own layouts of the debug recipe; it takes no overrides", file=sys.stderr)
        return 2
    settings = ValidationSettings(
        recipe=args.recipe or ValidationSettings.recipe,
        bandwidth_gbps=bandwidth,
        latency_us=latency,
        steps=args.validate_steps,
        timeout_s=args.validate_timeout,
        max_ranks=args.validate_ranks or default_max_ranks(),
    )
    chosen = [layout for layout in VALIDATION_LAYOUTS if world_size_of(layout) <= settings.max_ranks]
    left_out = [layout["name"] for layout in VALIDATION_LAYOUTS if layout not in chosen]
    print(
        f"validating the planner on {len(chosen)} layouts of gloo processes "
        f"({settings.recipe}; emulated link {bandwidth:g} GB/s, {latency:g} us on every group but pp; "
        f"{settings.steps} plain and {settings.steps} emulated steps each after a warm-up)",
        flush=True,
    )
    if left_out:
        print(
            f"left out (more processes than --validate-ranks {settings.max_ranks}; on fewer cores than "
            f"processes the waits are mostly each other's turns on a core): {', '.join(left_out)}",
            flush=True,
        )
    try:
        results = launch(settings)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = compare(results, settings)
    print(format_rows(rows))
    print(summary(rows))
    exposed_ok = all(row.within_bound for row in rows if row.judged)
    counts_ok = all(row.predicted == row.measured for row in rows if row.what in ("bytes", "messages"))
    return 0 if exposed_ok and counts_ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", help="the recipe to plan (required, except with --validate: debug.yaml)")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes in the job (default: tp*pp*dp with dp from the recipe, at least 1)",
    )
    parser.add_argument("--hardware", default=None, help="profile in tools/hardware/ (h100, h200, b200, gb200)")
    parser.add_argument("--efficiency", type=float, default=0.45, help="achieved share of the dense peak")
    parser.add_argument(
        "--search",
        action="store_true",
        help="list the fastest layouts of --world-size that the recipe accepts and that fit "
        "(also done when the recipe's own layout is refused and --hardware is given)",
    )
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the hardware profile's")
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        help="GiB per GPU, for --search and the plan's fits line (default: 90%% of the HBM)",
    )
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument(
        "--document-length",
        type=int,
        default=None,
        metavar="TOKENS",
        help="with data.document_boundaries=reset: sequences packed with documents of this many tokens, "
        "each kept apart (MLA attends within each: the FLOP count and step time say what that saves)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop searching after this much wall time and rank what was evaluated, saying how "
        "many layouts were not (default: no limit)",
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="run small layouts on 4 gloo CPU processes with an emulated network and print, per "
        "term, the planner's prediction against the measurement (bytes, messages, exposed "
        "seconds, bubble, memory)",
    )
    parser.add_argument(
        "--validate-link",
        default="0.02,100",
        metavar="GBPS,LATENCY_US",
        help="--validate: the emulated link of every group but the pipeline's (default 0.02,100: slow enough that the link, not the machine's own waits, dominates)",
    )
    parser.add_argument("--validate-steps", type=int, default=3, help="--validate: measured steps of each kind")
    parser.add_argument(
        "--validate-ranks",
        type=int,
        default=None,
        help="--validate: run the layouts of at most this many processes (default: the cores, 2 to 4)",
    )
    parser.add_argument("--validate-timeout", type=float, default=900.0, help="--validate: seconds for the launch")
    parser.add_argument("overrides", nargs="*", help="section.field=value, as for pretrain_k3.py")
    args = parser.parse_intermixed_args(argv)
    if args.validate:
        return validate(args)
    if not args.recipe:
        print("error: --recipe is required (except with --validate)", file=sys.stderr)
        return 2
    if args.search:
        return search(args)
    try:
        config = load_config(args.recipe, args.overrides)
        parallel = config.parallel
        world = args.world_size or parallel.tp * parallel.pp * parallel.cp * max(parallel.dp, 1)
        layout = layout_of(world, parallel, config.model)
        plan = PipelinePlan.from_config(config.model, parallel)
    except (ConfigError, LayoutError, PipelineConfigError) as error:
        searching = bool(args.hardware and args.world_size)
        # The layout check names sizes that merely divide the world ("these fit: tp=1 pp=1, …");
        # when the search follows, it names the layouts that the whole job accepts instead.
        print(f"error: {str(error).split('; with ', 1)[0] if searching else error}", file=sys.stderr)
        if searching:
            # The checks above name sizes that divide; the search keeps only the layouts that the
            # recipe's every check accepts and that fit in memory.
            print("layouts that the recipe accepts and that fit (every check of pretrain_k3.py, and memory):")
            search(args)
        return 2

    counts = parameter_counts(config.model)
    documents = None
    if args.document_length is not None and config.data.document_boundaries == "reset":
        documents = documents_of_length(config.data.seq_length, args.document_length)
    flops = training_flops_per_token(config.model, config.data.seq_length, document_lengths=documents)
    tokens = config.train.global_batch_size * config.data.seq_length
    print(
        f"model: {counts.total / 1e9:.3f}B parameters, {counts.active / 1e9:.3f}B active per token; "
        f"{flops.total / 1e9:.2f} GFLOP per token for training, {flops.total * tokens / 1e15:.3f} PFLOP per step"
    )
    if documents is not None:
        stream = training_flops_per_token(config.model, config.data.seq_length)
        print(
            f"documents: {len(documents)} of at most {args.document_length} tokens per sequence, kept apart "
            f"(data.document_boundaries=reset): MLA attention {flops.mla_attention / 1e9:.3f} GFLOP per token "
            f"against {stream.mla_attention / 1e9:.3f} as one stream; training {flops.total / stream.total:.4f}x"
        )
    print(
        f"layout: world {world} = tp {layout.tp} × cp {layout.cp} × dp {layout.data_parallel} × pp {layout.pp} (virtual stages "
        f"{layout.virtual_stages}); ep {layout.ep} within dp×tp; sequence parallel {parallel.sequence_parallel}; "
        f"ZeRO-1 {parallel.zero1}"
    )
    micro_batches = config.train.global_batch_size // (config.train.micro_batch_size * layout.data_parallel)
    print(
        f"batch: {config.train.global_batch_size} samples × {config.data.seq_length} tokens; "
        f"{micro_batches} micro-batches of {config.train.micro_batch_size} per data-parallel rank"
    )
    print()
    print("| pp rank | layers | parameters | weights+grads+masters+optimizer (GiB, upper estimate) |")
    print("| --- | --- | ---: | ---: |")
    for pp_rank in range(layout.pp):
        stage = rank_stage(config, layout, pp_rank, plan)
        expert_dp = layout.dp * layout.tp // layout.ep
        parameters, gib = memory_estimate(stage, config, min(layout.dp, expert_dp) if layout.ep > 1 else layout.dp)
        ranges = ", ".join(f"{start}-{end - 1}" for start, end in plan.layer_ranges(pp_rank))
        print(f"| {pp_rank} | {ranges} | {parameters:,} | {gib:,.2f} |")
    print()
    print("| " + " | ".join(MEMORY_HEADER) + " |")
    print("| " + " | ".join(["---"] * len(MEMORY_HEADER)) + " |")
    step_bytes: dict[str, float] = {}
    wire: dict[str, float] = {}
    wire_parts: dict[str, float] = {}  # the same with the ZeRO-1 exchange apart (`dp.exchange`)
    buckets: dict[str, list[tuple[float, float]]] = {}
    zero1_wire = (0.0, 0.0)  # (now, with every gradient bucket all-reduced), network groups, fullest stage
    ranks = []
    for pp_rank in range(layout.pp):
        job = build_planning_rank(config, layout, layout.rank_of(0, 0, pp_rank))
        if pp_rank == 0:
            first_job = job
        ranks.append(rank_memory(job, layout, micro_batches))
        print("| " + " | ".join(ranks[-1].row()) + " |")
        for group, nbytes in layout_step_bytes(job, micro_batches).items():
            step_bytes[group] = max(step_bytes.get(group, 0.0), nbytes)
        now = data_parallel_wire_bytes(job)
        for group, nbytes in now.items():
            wire[group] = max(wire.get(group, 0.0), nbytes)
        for part, nbytes in data_parallel_wire_bytes(job, exchange_apart=True).items():
            wire_parts[part] = max(wire_parts.get(part, 0.0), nbytes)
        for group, schedule in gradient_bucket_schedule(job).items():  # the fullest stage's buckets
            if sum(b for b, _ in schedule) > sum(b for b, _ in buckets.get(group, [])):
                buckets[group] = schedule
        before = data_parallel_wire_bytes(job, all_reduced=True)
        totals = (
            sum(v for g, v in now.items() if g in DATA_GROUPS),
            sum(v for g, v in before.items() if g in DATA_GROUPS),
        )
        zero1_wire = max(zero1_wire, totals)
    # The search's limit (`--memory-limit`, else 90% of the HBM of --hardware, H200 by default).
    verdict = memory_verdict(ranks, load_profile(args.hardware or "h200"), args.memory_limit)
    print()
    print(verdict.line(search_hint(args, world)))
    print()
    print(
        "bytes per rank and step (largest stage, counted as parallel/comm.py counts them): "
        + "; ".join(f"{group} {nbytes / _GIB:,.2f} GiB" for group, nbytes in sorted(step_bytes.items()))
    )
    print(
        "data-parallel gradients + ZeRO-1 exchange on the wire (ring; largest stage): "
        + "; ".join(f"{group} {nbytes / _GIB:,.2f} GiB" for group, nbytes in sorted(wire.items()))
        + (
            f" (gradients all-reduced instead: {zero1_wire[1] / _GIB:,.2f} GiB over dp/data_tensor/expert_dp, "
            f"now {zero1_wire[0] / _GIB:,.2f})"
            if parallel.zero1 and layout.dp > 1
            else ""
        )
    )
    if args.hardware:
        hardware = load_profile(args.hardware)
        tp_overlap = overlapped_tensor_regions(config, layout)
        estimate = estimate_step_time(
            config.model,
            layout,
            plan,
            hardware,
            micro_batch_size=config.train.micro_batch_size,
            seq_length=config.data.seq_length,
            micro_batches=micro_batches,
            precision=config.train.precision,
            comm_bytes={
                **step_bytes,
                **{part: v for part, v in wire_parts.items() if part.split(".")[0] in DATA_GROUPS},
            },
            efficiency=args.efficiency,
            document_lengths=documents,
            ep_overlap_chunks=config.parallel.ep_overlap_chunks,
            ep_overlap_halves=config.parallel.ep_overlap_halves,
            gradient_buckets=buckets,
            tp_overlap=tp_overlap,
        )
        print(
            f"\n{hardware.name}, {args.efficiency:.0%} of the dense peak: step {estimate.step_s:.2f} s, "
            f"{estimate.tokens_per_s:,.0f} tokens/s, MFU {estimate.mfu:.1%}"
        )
        if parallel.tp_overlap_chunks and layout.tp > 1:
            print(
                f"TP entries of every mixer and MLP region overlapped in {tp_overlap.pieces} piece(s), "
                + (
                    f"leaves in {tp_overlap.leave_pieces} (torch projections)"
                    if tp_overlap.leave_pieces
                    else "leaves exposed (model.recompute=sublayer keeps them unfused; torch projections)"
                )
                if tp_overlap is not None
                else "TP priced exposed: parallel.tp_overlap_chunks overlaps plain torch projections only, and "
                f"model.linear_backend={config.model.linear_backend} runs Transformer Engine's on CUDA where it imports "
                "(model.linear_backend=torch to price the overlap)"
            )
        print("| term | seconds | share | link |")
        print("| --- | ---: | ---: | --- |")
        print(f"| compute | {estimate.compute_s:.2f} | {estimate.shares()['compute']:.0%} | |")
        print(f"| pipeline bubble | {estimate.bubble_s:.2f} | {estimate.shares()['bubble']:.0%} | |")
        for group, seconds in estimate.exposed_comm_s.items():
            print(
                f"| {group} comm (exposed) | {seconds:.2f} | {estimate.shares()[group + ' comm']:.0%} "
                f"| {estimate.links[group]} |"
            )
    if layout.pp > 1:
        print()
        print(
            "AttnRes blocks per micro-batch across pipeline hops (forward; backward returns as many): "
            + ", ".join(
                f"{protocol} {plan.blocks_per_micro_batch(protocol)}" for protocol in ("naive", "paper", "exact")
            )
        )
    # Global rank 0's step, every group, bytes and messages (the formula the comm test holds to
    # the counters; first step: no replica weights yet).
    traffic = predicted_job_traffic(first_job, micro_batches, 2 if config.train.precision != "fp32" else 4)
    print()
    print(
        "communication of one step on rank 0 (bytes, messages): "
        + "; ".join(f"{group} {nbytes:,} B in {messages:,}" for group, (nbytes, messages) in traffic.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
