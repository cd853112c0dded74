"""Every layout the planner suggests runs: it passes the job's own checks (the strict recipe
loader with the overrides, `resolve_layout`, `PipelinePlan.from_config`) and rank 0 builds on the
meta device as `pretrain_k3.py` builds it."""

import pytest

from k3train.config import load_config
from k3train.parallel.pipeline_schedule import PipelinePlan, check_interleaved_micro_batches
from k3train.parallel.state import layout_of
from k3train.planning.hardware import load_profile
from k3train.planning.search import describe_candidates, nearest_fitting_world_sizes, search_layouts
from k3train.training.build import build_planning_rank
from tests.distributed.harness import CHECKOUT

DEBUG = str(CHECKOUT / "recipes" / "debug.yaml")
K3 = str(CHECKOUT / "recipes" / "k3.yaml")


def assert_runs(recipe: str, world_size: int, overrides: list[str]) -> None:
    config = load_config(recipe, overrides)
    p, m = config.parallel, config.model
    layout = layout_of(world_size, p, m)
    PipelinePlan.from_config(m, p)
    if p.virtual_stages > 1:
        check_interleaved_micro_batches(p.pp, config.train.micro_batches_per_rank(layout.data_parallel))
    job = build_planning_rank(config, layout, 0)
    assert sum(param.numel() for param in job.model.parameters()) > 0


@pytest.mark.parametrize("world_size", [4, 8])
def test_debug_suggestions_run(world_size):
    found = search_layouts(DEBUG, world_size, load_profile("h100"), top=4)
    assert found and "| tp |" in describe_candidates(found)
    assert found == sorted(found, key=lambda c: (round(c.time.step_s, 6), c.memory_gib))
    for candidate in found:
        assert candidate.tp * candidate.pp * candidate.cp * candidate.dp == world_size
        assert_runs(DEBUG, world_size, candidate.overrides())
    # And the planner itself takes the first suggestion (every stage built, every term priced).
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            str(CHECKOUT / "tools" / "plan.py"),
            "--recipe",
            DEBUG,
            "--world-size",
            str(world_size),
            "--hardware",
            "h100",
            *found[0].overrides(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=CHECKOUT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "communication of one step on rank 0" in result.stdout


def test_memory_limit_excludes_and_nearest_sizes_fit():
    hardware = load_profile("h200")
    assert search_layouts(DEBUG, 8, hardware, memory_limit_gib=1e-6) == []
    sizes = nearest_fitting_world_sizes(K3, 1000, hardware, count=2)
    assert sizes and all(size != 1000 and size % 8 == 0 for size in sizes)
    for size in sizes:
        best = search_layouts(K3, size, hardware, first_fit=True)[0]
        assert best.memory_gib <= hardware.memory_gib * 0.9 * 1e9 / 2**30
        assert_runs(K3, size, best.overrides())


@pytest.mark.parametrize(
    "recipe,world_size,overrides",
    [
        (
            DEBUG,
            8,
            ["parallel.tp=2", "parallel.dp=2", "parallel.pp=2", "parallel.ep=2", "parallel.sequence_parallel=true"],
        ),
        (
            DEBUG,
            8,
            [
                "parallel.tp=2",
                "parallel.dp=2",
                "parallel.pp=2",
                "parallel.ep=4",
                "parallel.sequence_parallel=true",
                "parallel.expert_dispatch=capacity",
            ],
        ),
        (DEBUG, 4, ["parallel.dp=2", "parallel.pp=2", "parallel.ep=2", "model.recompute=sublayer"]),
        (K3, 1024, []),
    ],
    ids=["debug tp2 dp2 pp2 ep2 balanced", "debug ep4 capacity", "debug ep2 sublayer", "k3 recipe at 1024"],
)
def test_search_terms_match_the_built_ranks(recipe, world_size, overrides):
    """The search ranks thousands of layouts without building them; its per-group bytes must be
    the built ranks' (`layout_step_bytes`, `data_parallel_wire_bytes`): pipeline hops of rank 1
    and the expert traffic of the busiest rank exactly, TP within 5% (the built rank adds the
    ZeRO-1 TP-partial segments: 3.4% on the debug model), data-parallel ring bytes from the padding-free volume to 1.6× it
    (owner rows, the padded pool and exchange, the embedding's broadcast)."""
    from k3train.planning.layout_traffic import data_parallel_wire_bytes, layout_step_bytes
    from k3train.planning.search import analytic_step_bytes

    config = load_config(recipe, overrides)
    p, m = config.parallel, config.model
    layout = layout_of(world_size, p, m)
    plan = PipelinePlan.from_config(m, p)
    micro_batches = config.train.micro_batches_per_rank(layout.data_parallel)
    analytic = analytic_step_bytes(config, layout, plan)
    busiest = max(
        range(layout.pp), key=lambda r: sum(m.is_moe_layer(i) for s, e in plan.layer_ranges(r) for i in range(s, e))
    )
    built = {
        rank: build_planning_rank(config, layout, layout.rank_of(0, 0, rank)) for rank in {0, 1, busiest, layout.pp - 1}
    }
    step = {rank: layout_step_bytes(job, micro_batches) for rank, job in built.items()}
    assert analytic["pp"] == step[1]["pp"]
    assert analytic["ep"] == step[busiest]["ep"]
    if layout.tp > 1:
        assert analytic["tp"] == pytest.approx(step[busiest]["tp"], rel=0.05)
    wires = [data_parallel_wire_bytes(job) for job in built.values()]  # the fullest stage, as the search
    for group in ("dp", "expert_dp"):
        measured = max(
            wire.get(group, 0.0) + (wire.get("data_tensor", 0.0) if group == "dp" else 0.0) for wire in wires
        )
        # ZeRO-1's exchange is priced apart (`dp.exchange`, exposed after the step): the same bytes
        predicted = analytic.get(group, 0.0) + analytic.get(f"{group}.exchange", 0.0)
        assert predicted * 0.99 <= measured <= 1.6 * predicted, (group, analytic, wires)


def reference_search(recipe: str, world_size: int, hardware, limit_gib: float, options) -> list:
    """The search without its cache, screen or budget: every option checked and every recompute
    setting priced from scratch, as the planner did before they were added."""
    import dataclasses

    from k3train.planning.search import RECOMPUTE, Candidate, accepted, estimate

    base = load_config(recipe)
    found = []
    for option in options:
        checked = accepted(base, option.overrides(), world_size)
        if checked is None:
            continue
        config, layout, plan = checked
        for recompute in RECOMPUTE:
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, recompute=recompute))
            memory, time = estimate(config, layout, plan, hardware, 0.45)
            if memory <= limit_gib:
                found.append(
                    Candidate(
                        option.tp,
                        option.pp,
                        option.virtual_stages,
                        option.ep,
                        option.dp,
                        option.cp,
                        recompute,
                        option.micro_batch_size,
                        option.expert_dispatch,
                        memory,
                        time,
                    )
                )
    return sorted(found, key=lambda c: (round(c.time.step_s, 6), c.memory_gib))


def test_cache_and_screen_keep_the_search_s_answer():
    """With a limit that the weights of some layouts already exceed (so the screen drops them
    unpriced), the search returns exactly the reference's candidates, numbers included."""
    from k3train.planning.search import LayoutSearch

    hardware = load_profile("h100")
    search = LayoutSearch(DEBUG, hardware)
    options = search.options(8)
    screens = [search.screen(8, option) for option in options]
    statics = sorted({screen.static_gib for screen in screens if not screen.refused})
    limit = (statics[0] + statics[-1]) / 2  # weights alone exceed it on some layouts, not on others
    assert any(s > limit for s in statics) and any(s <= limit for s in statics)
    outcome = LayoutSearch(DEBUG, hardware, memory_limit_gib=limit).run(8, top=10_000)
    assert outcome.candidates and outcome.evaluated == outcome.layouts and not outcome.out_of_budget
    assert list(outcome.candidates) == reference_search(DEBUG, 8, hardware, limit, options)


def test_budget_stops_the_search_cleanly():
    """A budget that runs out part-way returns the best of the layouts evaluated so far and
    counts the rest; a spent budget stops the nearest-size probing too."""
    import itertools

    from k3train.planning.search import LayoutSearch
    from k3train.planning.search_budget import SearchBudget

    hardware = load_profile("h100")
    ticks = itertools.count()
    budget = SearchBudget(seconds=40, clock=lambda: float(next(ticks)))  # one tick per option checked
    search = LayoutSearch(DEBUG, hardware, budget=budget)
    outcome = search.run(8, top=3)
    assert outcome.out_of_budget and 0 < outcome.evaluated < outcome.layouts
    assert outcome.unevaluated == outcome.layouts - outcome.evaluated
    evaluated_options = search.options(8)[: outcome.evaluated // 3]
    assert (
        list(outcome.candidates)
        == reference_search(DEBUG, 8, hardware, hardware.memory_limit_gib(), evaluated_options)[:3]
    )
    nearest = search.nearest_fitting_world_sizes(6, step=8)
    assert nearest.out_of_budget and nearest.sizes == ()


def test_one_rank_state_per_layout(monkeypatch):
    """Building a rank-0 `ParallelState` walks every group of the world; at K3 × 1,024 building
    one per pipeline rank of every layout was about 85% of the search's CPU time (cProfile). The
    search builds one per distinct layout."""
    from k3train.planning import search_cache
    from k3train.planning.search import LayoutSearch

    calls = []
    original = search_cache.planning_parallel_state
    monkeypatch.setattr(search_cache, "planning_parallel_state", lambda *a: calls.append(a) or original(*a))
    search = LayoutSearch(DEBUG, load_profile("h100"))
    assert search.run(8).candidates
    layouts = {(o.tp, o.pp, o.dp, o.ep, o.virtual_stages) for o in search.options(8)}
    assert 0 < len(calls) <= len(layouts)
