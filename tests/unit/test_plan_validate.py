"""`tools/plan.py --validate` and the rules it checks: the gradient buckets' replay
(`planning/overlap.py`), the ZeRO-1 exchange priced apart, and the comparison of the planner's
terms with a run's (`planning/validate.py`), on results built by hand from the planner's own
traffic terms (`tests/distributed/test_plan_validate_launch.py` runs a real launch)."""

from __future__ import annotations

import copy
import importlib.util

import pytest

from k3train.planning.overlap import even_buckets, exposed_gradient_buckets_s
from k3train.planning.validate import (
    JUDGED_FROM_S,
    VALIDATION_LAYOUTS,
    ValidationSettings,
    compare,
    predicted_exposed,
    summary,
)
from tests.distributed.harness import CHECKOUT


def test_a_bucket_full_at_the_end_of_the_backward_is_wholly_exposed():
    assert exposed_gradient_buckets_s([(0.3, 1.0)], backward_s=2.0) == pytest.approx(0.3)


def test_buckets_full_early_hide_behind_the_backward_and_queue_on_the_link():
    # 1 s each, full at 0 s and 0.5 s of a 3 s backward: the second waits for the first (busy
    # until 1 s) and is done at 2 s, hidden; with a 1.5 s backward 0.5 s stays exposed.
    buckets = [(1.0, 0.0), (1.0, 0.5 / 3)]
    assert exposed_gradient_buckets_s(buckets, backward_s=3.0) == 0.0
    assert exposed_gradient_buckets_s([(1.0, 0.0), (1.0, 0.5 / 1.5)], backward_s=1.5) == pytest.approx(0.5)


def test_even_buckets_split_the_bytes_and_the_backward():
    buckets = even_buckets(2.5, 1.0)
    assert [seconds for seconds, _ in buckets] == pytest.approx([1.0, 1.0, 0.5])
    assert [share for _, share in buckets] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert even_buckets(0.0, 1.0) == []


def _synthetic_results(layout, settings, wait_scale: float = 1.0):
    """Per-rank results of `layout` as the worker reports them, with the emulated steps' waits set
    to the planner's own prediction × `wait_scale` over plain waits of 10 ms each, and counted
    bytes equal to the terms."""
    from k3train.config import load_config
    from k3train.parallel.state import layout_of
    from k3train.planning.layout_traffic import gradient_bucket_schedule
    from k3train.planning.measured import layout_overrides
    from k3train.planning.traffic import job_traffic_terms
    from k3train.training.build import build_planning_rank

    config = load_config(
        settings.recipe,
        layout_overrides(layout, settings.micro_batch_size, settings.micro_batches, settings.seq_length),
    )
    world = layout.get("tp", 1) * layout.get("dp", 1) * layout.get("pp", 1)
    grid = layout_of(world, config.parallel, config.model)
    per_rank = []
    for rank in range(world):
        job = build_planning_rank(config, grid, rank)
        traffic_terms = job_traffic_terms(job, settings.micro_batches)
        terms: list[list] = [[t.group, t.what, t.bytes, t.messages] for t in traffic_terms]
        buckets = {g: [list(b) for b in rows] for g, rows in gradient_bucket_schedule(job, counted=True).items()}
        predicted, _ = predicted_exposed(layout, settings, terms, buckets, compute_s=1.0)
        counted: dict[str, list[int]] = {}
        for term in traffic_terms:
            counted.setdefault(term.group, [0, 0])
            counted[term.group][0] += term.bytes
            counted[term.group][1] += term.messages
        plain = {label: 0.01 for label in predicted}
        emulated = {label: 0.01 + seconds * wait_scale for label, seconds in predicted.items()}
        step = dict(step_s=1.0 + sum(plain.values()) + 0.1, optimizer_s=0.1, loss=1.0, counted=counted)
        memory = dict(weights=4.0, gradients=4.0, master=0.0, optimizer=8.0, activations=10.0)
        per_rank.append(
            dict(
                name=layout["name"],
                terms=terms,
                buckets=buckets,
                steps=dict(plain=[dict(step, exposed=plain)], emulated=[dict(step, exposed=emulated)]),
                measured_memory=memory,
                predicted_memory=dict(memory, activations=11.0),
            )
        )
    return per_rank


@pytest.mark.parametrize("name", ["TP2+SP", "TP2+SP, 4 TP pieces", "EP2 relay"])
def test_compare_holds_a_run_that_waits_as_predicted_and_flags_one_that_does_not(name):
    settings = ValidationSettings(bandwidth_gbps=0.02)
    layout = next(layout for layout in VALIDATION_LAYOUTS if layout["name"] == name)
    exact = compare([(layout, _synthetic_results(layout, settings))], settings)
    judged = [row for row in exact if row.judged]
    assert judged and all(row.within_bound for row in judged)
    assert all(row.predicted == row.measured for row in exact if row.what in ("bytes", "messages"))
    # the compute the estimate was calibrated to: step - waits - optimizer = 1 s
    memory = {row.term: row.ratio for row in exact if row.what == "memory B"}
    assert memory["activations"] == pytest.approx(1.1) and "master" not in memory
    assert "0 of" not in summary(exact)

    slow = compare([(layout, _synthetic_results(layout, settings, wait_scale=1.25))], settings)
    assert all(not row.within_bound for row in slow if row.judged)  # 1/1.25 = 0.8: off by 20%
    tiny = [row for row in slow if row.what == "exposed s" and not row.judged]
    assert all(max(row.predicted, row.measured) < JUDGED_FROM_S for row in tiny)


def test_a_byte_count_that_differs_is_shown():
    settings = ValidationSettings()
    layout = next(layout for layout in VALIDATION_LAYOUTS if layout["name"] == "DP2")
    results = _synthetic_results(layout, settings)
    changed = copy.deepcopy(results)
    changed[0]["steps"]["emulated"][-1]["counted"]["dp"][0] += 4
    rows = compare([(layout, changed)], settings)
    row = next(r for r in rows if r.term == "dp" and r.what == "bytes")
    assert row.measured == row.predicted + 4


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--validate-link", "fast"], "--validate-link must be GBPS,LATENCY_US"),
        (["parallel.tp=2"], "takes no overrides"),
    ],
)
def test_validate_refuses_bad_options_in_one_line(arguments, message, capsys):
    spec = importlib.util.spec_from_file_location("plan_cli_validate", CHECKOUT / "tools" / "plan.py")
    assert spec is not None and spec.loader is not None
    plan_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_cli)
    assert plan_cli.main(["--validate", *arguments]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
