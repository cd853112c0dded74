"""Pipeline parallelism reproduces the single-process loss and gradients (gloo, CPU), sends exactly
the blocks the plan says, and holds each block once per rank per micro-batch in flight.

Two launches: one of 2 ranks (every PP2 configuration: 1F1B and interleaved V=2, AttnRes modes
block, full and none, layer splits whose block boundaries fall inside chunks), one of 4 ranks
(PP4 and PP4 V=2 in every mode, PP2×TP2 with and without sequence parallelism, PP2×DP2).

Tolerance: float64 throughout. The pipelined model runs the same operations as one process; it
sums a block's gradient contributions (and, under TP/DP, partial gradients over ranks) in a
different order, so differences are rounding in the last bits: 1e-12 absolute on the loss (≈ 6)
and on every gradient (largest entries O(1e-1)); the runs reach about 1e-15.
"""

from collections import defaultdict
from typing import Any

import pytest

from tests.distributed.harness import run_workers

TOLERANCE = 1e-12

CHECKS_2: list[dict[str, Any]] = [
    # 1F1B: any number of micro-batches; block size 3 over a 3 + 5 split (a block spans the boundary).
    {"name": "pp2_v1_block", "pp": 2, "micro_batches": 3, "pipeline_layers": [3, 5], "probe": True},
    {"name": "pp2_v1_full", "pp": 2, "micro_batches": 2, "config": {"attn_res": "full"}},
    {"name": "pp2_v1_none", "pp": 2, "micro_batches": 2, "pipeline_layers": [5, 3], "config": {"attn_res": "none"}},
    # Interleaved, V = 2: the cache pays off; uneven chunks, blocks not aligned with them.
    {
        "name": "pp2_v2_block",
        "pp": 2,
        "virtual_stages": 2,
        "micro_batches": 4,
        "pipeline_layers": [2, 3, 1, 2],
        "probe": True,
        "forward_only": True,
    },
    # docs/design.md §2.1's worked example: 8 layers, S = 2, chunks of 2 layers: exact 3 blocks vs paper 5, naive 6.
    {
        "name": "pp2_v2_block_spec_table",
        "pp": 2,
        "virtual_stages": 2,
        "micro_batches": 2,
        "config": {"attn_res_block_size": 2},
    },
    {
        "name": "pp2_v2_full",
        "pp": 2,
        "virtual_stages": 2,
        "micro_batches": 2,
        "pipeline_layers": [1, 3, 2, 2],
        "config": {"attn_res": "full"},
        "probe": True,
    },
    {"name": "pp2_v2_none", "pp": 2, "virtual_stages": 2, "micro_batches": 4, "config": {"attn_res": "none"}},
    # Without checkpointing the AttnRes mix saves the stacked sources: the probe must see those copies.
    {
        "name": "pp2_v2_block_no_recompute",
        "pp": 2,
        "virtual_stages": 2,
        "micro_batches": 2,
        "config": {"recompute": "none"},
        "probe": True,
    },
]

CHECKS_4: list[dict[str, Any]] = [
    {"name": "pp4_v1_block", "pp": 4, "micro_batches": 5, "pipeline_layers": [1, 3, 2, 2]},
    {"name": "pp4_v1_none", "pp": 4, "micro_batches": 3, "config": {"attn_res": "none"}},
    {"name": "pp4_v2_block", "pp": 4, "virtual_stages": 2, "micro_batches": 4, "probe": True, "forward_only": True},
    {"name": "pp4_v2_full", "pp": 4, "virtual_stages": 2, "micro_batches": 4, "config": {"attn_res": "full"}},
    {"name": "pp4_v2_none", "pp": 4, "virtual_stages": 2, "micro_batches": 4, "config": {"attn_res": "none"}},
    {
        "name": "pp2_tp2_v2_block",
        "pp": 2,
        "tp": 2,
        "virtual_stages": 2,
        "micro_batches": 2,
        "pipeline_layers": [3, 1, 2, 2],
    },
    {
        "name": "pp2_tp2_sp_full",
        "pp": 2,
        "tp": 2,
        "sequence_parallel": True,
        "micro_batches": 2,
        "config": {"attn_res": "full"},
    },
    {"name": "pp2_dp2_v2_block", "pp": 2, "virtual_stages": 2, "micro_batches": 2, "pipeline_layers": [3, 2, 1, 2]},
]


def _launch(world_size, checks):
    per_rank = run_workers(
        world_size, "tests.distributed.workers_pipeline:run_checks", {"checks": checks}, timeout_s=200
    )
    by_check = defaultdict(list)
    for results in per_rank:
        for result in results:
            by_check[result["name"]].append(result)
    return by_check


@pytest.fixture(scope="module")
def two_ranks():
    return _launch(2, CHECKS_2)


@pytest.fixture(scope="module")
def four_ranks():
    return _launch(4, CHECKS_4)


def _assert_check(results, check):
    name = check["name"]
    for r in results:
        assert abs(r["loss"] - r["reference_loss"]) < TOLERANCE, (name, r["rank"], r["loss"], r["reference_loss"])
        assert r["max_grad_error"] < TOLERANCE, (name, r["rank"], r["worst_param"], r["max_grad_error"])
        # Traffic: what comm.py counted on each rank is the plan's exact-delta count.
        assert r["traffic"] == {"pp.forward": r["predicted"]["forward"], "pp.backward": r["predicted"]["backward"]}, (
            name,
            r["rank"],
            r["traffic"],
            r["predicted"],
        )
        # Memory: each block once per rank per micro-batch in flight (the plan's peak).
        assert r["peak_live_blocks"] == r["theoretical_peak"], (name, r["rank"], r["peak_live_blocks"])
        # The gradient-sync hook sees exactly one last backward per chunk.
        assert r["last_backward_calls"] == {v: 1 for v in range(check.get("virtual_stages", 1))}, (name, r)
        if check.get("forward_only"):
            assert r["forward_only_loss"] is not None
            assert abs(r["forward_only_loss"] - r["reference_loss"]) < TOLERANCE, (name, r["rank"])
    # Every parameter of the model is checked, on exactly one pipeline rank of each replica.
    replicas = defaultdict(list)
    for r in results:
        replicas[(r["tp_rank"], r["dp_rank"])].append(r)
    for replica in replicas.values():
        names = [n for r in replica for n in r["checked"]]
        assert sorted(names) == replica[0]["all_reference_params"], name
        # The replica's hops together carry exactly the exact-delta bytes (forward + backward),
        # no more than the paper's increments, no more than the full history.
        total = sum(r["traffic"]["pp.forward"] + r["traffic"]["pp.backward"] for r in replica)
        protocol = replica[0]["protocol_bytes"]
        assert total == protocol["exact"] <= protocol["paper"] <= protocol["naive"], (name, total, protocol)


def _assert_probe(results):
    for r in results:
        assert r["probe_mismatches"] == [], r["probe_mismatches"]
        assert r["saved_copies"] == 0, (r["name"], r["rank"], r["saved_copies"])
        # The AttnRes mix saves its sources as they are (the cache's own storage), never a stacked
        # copy, with or without recompute.
        assert r["stacked_copies"] == 0, (r["name"], r["rank"], r["stacked_copies"])


@pytest.mark.parametrize("check", CHECKS_2, ids=[c["name"] for c in CHECKS_2])
def test_pp2_matches_single_process(two_ranks, check):
    results = two_ranks[check["name"]]
    assert len(results) == 2
    _assert_check(results, check)
    if check.get("probe"):
        _assert_probe(results)


@pytest.mark.parametrize("check", CHECKS_4, ids=[c["name"] for c in CHECKS_4])
def test_pp4_tp_dp_match_single_process(four_ranks, check):
    results = four_ranks[check["name"]]
    assert len(results) == 4
    _assert_check(results, check)
    if check.get("probe"):
        _assert_probe(results)
    if "dp2" in check["name"]:
        assert {r["dp_reduction"] for r in results} <= {"GradientReducer", "all_reduce"}


def test_spec_table_traffic(two_ranks):
    """docs/design.md §2.1: per micro-batch the hops carry 6 (naive), 5 (paper), 3 (exact) blocks."""
    result = two_ranks["pp2_v2_block_spec_table"][0]
    assert result["hop_blocks"] == {"naive": [1, 2, 3], "paper": [1, 2, 2], "exact": [1, 1, 1]}
