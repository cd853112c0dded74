"""Measured communication of one training step equals the formula (`k3train/planning/traffic.py`), per
group, in bytes and in messages, on every rank: `step_traffic_terms` for pp = ep = 1, and for every
layout `job_traffic_terms` of the rank's own meta-device build (`build_planning_rank`), the
function `tools/plan.py` and the planner use.

One 4-rank gloo launch runs several layouts through the real training step
(`workers_comm.py`); the prediction is computed for each rank's own coordinates, because under
ZeRO-1 the `tp` traffic of Muon's whole-matrix gathers depends on the DP rank that owns them.
The counts are exact integers: any extra, missing or resized collective fails the test.
"""

import pytest

from k3train.config import load_config
from k3train.planning.traffic import predicted_step_traffic, step_traffic_terms
from tests.distributed.harness import CHECKOUT, run_workers

RECIPE = str(CHECKOUT / "recipes" / "debug.yaml")
LAYOUTS = [
    dict(name="TP2+SP", tp=2, sequence_parallel=True),
    # The entries and leaves overlapped with their GEMMs: the same bytes in 3 pieces each way.
    dict(
        name="TP2+SP overlapped entries and leaves",
        tp=2,
        sequence_parallel=True,
        overrides=["parallel.tp_overlap_chunks=3"],
    ),
    # (without SP the overlapped leaves all-reduce in 2 pieces in forward)
    dict(name="DP2×TP2 ZeRO-1, TP in 2 pieces", tp=2, dp=2, zero1=True, overrides=["parallel.tp_overlap_chunks=2"]),
    # The other balancers' statistics, SP without ZeRO-1, and recompute's extra gathers.
    dict(
        name="DP2×TP2+SP exact quantile",
        tp=2,
        dp=2,
        sequence_parallel=True,
        zero1=False,
        overrides=["model.balancer=quantile"],
    ),
    dict(
        name="TP2+SP recompute=sublayer sign",
        tp=2,
        sequence_parallel=True,
        # (overlapped entries; the leaves of a recomputed sublayer stay unfused)
        overrides=["model.recompute=sublayer", "model.balancer=sign", "parallel.tp_overlap_chunks=2"],
    ),
    dict(name="DP2 ZeRO-1", dp=2, zero1=True),
    # Gradients reduce-scattered to four owners (uneven segments, padded).
    dict(name="DP4 ZeRO-1", dp=4, zero1=True),
    # Pipeline hops (exact-delta blocks) and expert all-to-alls: pp.forward/pp.backward and ep only.
    dict(name="PP2×DP2", pp=2, dp=2, overrides=["model.attn_res_block_size=1"]),
    dict(name="PP2 interleaved", pp=2, overrides=["parallel.virtual_stages=2"]),
    # relay: the static-shape transport whose bytes the formula gives (`auto` is `splits` on gloo,
    # exact rows that depend on the routing; the step line reports those as measured)
    dict(name="EP2 balanced", dp=2, ep=2, overrides=["parallel.ep_transport=relay"]),
    # expert_dp = 2: replica gradients reach the home experts in backward (online replicas), so
    # the expert_dp all-reduce is the home gradients' buckets alone; the spread transport
    dict(name="EP2×expert_dp2 balanced spread", dp=4, ep=2, overrides=["parallel.ep_transport=spread"]),
    # the overlapped schedule: per-chunk buffers, one loads all-gather for every chunk
    dict(
        name="EP2 balanced relay overlapped",
        dp=2,
        ep=2,
        overrides=["parallel.ep_transport=relay", "parallel.ep_overlap_chunks=3"],
    ),
    # alternating halves: each half its own chunk buffers, loads all-gather and replica exchange
    dict(
        name="EP2 balanced spread overlapped halves",
        dp=2,
        ep=2,
        micro_batch_size=2,  # one micro-batch of two sequences (as many tokens as the others)
        overrides=["parallel.ep_transport=spread", "parallel.ep_overlap_chunks=2", "parallel.ep_overlap_halves=true"],
    ),
    # under TP2+SP: every TP region runs once per half (the same bytes, twice the messages)
    dict(
        name="TP2×EP2+SP balanced spread overlapped halves",
        tp=2,
        dp=2,
        ep=2,
        sequence_parallel=True,
        micro_batch_size=2,
        overrides=["parallel.ep_transport=spread", "parallel.ep_overlap_chunks=2", "parallel.ep_overlap_halves=true"],
    ),
    # and with `step` replicas: the halves share the step's fetch and its one return home
    dict(
        name="EP2 balanced relay overlapped halves step",
        dp=2,
        ep=2,
        micro_batch_size=2,
        overrides=[
            "parallel.ep_transport=relay",
            "parallel.ep_overlap_chunks=2",
            "parallel.ep_overlap_halves=true",
            "parallel.ep_replica_planning=step",
        ],
    ),
    # `step` replicas: their gradients return home in the step's last backward, so over expert_dp
    # only the home gradients' buckets travel (as with online replicas)
    dict(
        name="EP2×expert_dp2 balanced step relay",
        dp=4,
        ep=2,
        overrides=["parallel.ep_transport=relay", "parallel.ep_replica_planning=step"],
    ),
    dict(
        name="EP2 capacity ×TP2+SP", tp=2, ep=2, sequence_parallel=True, overrides=["parallel.expert_dispatch=capacity"]
    ),
    # Combinations: ZeRO-1's TP-partial gradients under SP (reduce-scatter over dp, then the owner's
    # segment over tp); pipeline stages with expert parallelism and ZeRO-1 together.
    dict(name="DP2×TP2+SP ZeRO-1", tp=2, dp=2, sequence_parallel=True, zero1=True),
    dict(name="PP2×DP2 EP2 balanced ZeRO-1", pp=2, dp=2, ep=2, zero1=True, overrides=["parallel.ep_transport=relay"]),
    # An emulated network (0.5 GB/s, 2 ms per EP collective; 1 GB/s, 0.5 ms on dp) delays
    # collectives without changing what they carry.
    dict(
        name="EP2 balanced emulated network",
        dp=2,
        ep=2,
        overrides=["parallel.ep_transport=relay", "parallel.emulate_network={ep: [0.5, 2000], dp: [1, 500]}"],
    ),
    # recompute=sublayer reruns each MoE layer's forward all-to-alls in backward.
    dict(
        name="EP2 balanced recompute=sublayer",
        dp=2,
        ep=2,
        overrides=["model.recompute=sublayer", "parallel.ep_transport=relay"],
    ),
]


def test_measured_traffic_equals_formula_per_group_and_rank():
    payload = dict(recipe=RECIPE, micro_batch_size=1, micro_batches=2, seq_length=32, layouts=LAYOUTS)
    results = run_workers(4, "tests.distributed.workers_comm:run_layouts", payload, timeout_s=600)
    for index, layout in enumerate(LAYOUTS):
        world = layout.get("tp", 1) * layout.get("dp", 1) * layout.get("pp", 1)
        for rank in range(world):
            result = results[rank][index]
            assert result["member"]
            assert result["measured"] == result["predicted"], (
                layout["name"],
                rank,
                result["measured"],
                result["predicted"],
            )
            # The any-layout prediction from the rank's own build agrees (pp = ep = 1: with the formula).
            assert result["predicted_job"] == result["predicted"], (layout["name"], rank)
        assert (
            "tp" in results[0][index]["measured"]
            or layout.get("tp", 1) == 1
            or layout.get("pp", 1) > 1
            or layout.get("ep", 1) > 1
        )
        if layout.get("pp", 1) > 1:
            assert {"pp.forward", "pp.backward"} <= {
                group for rank in range(world) for group in results[rank][index]["predicted"]
            }
        if layout.get("ep", 1) > 1:
            assert results[0][index]["predicted"]["ep"][0] > 0
    # Every rank waited in its groups' collectives; under the emulated link (a sleep never ends
    # early) a rank's EP transfers take at least bytes / 0.5 GB/s of waiting, and every launch pays
    # the 2 ms latency once. A hop's ids and rows go out together and share one latency, so at
    # least half of the messages pay it: the step's EP wait is at least messages / 2 × 2 ms +
    # bytes / 0.5 GB/s (these exchanges are launched and awaited back to back: no chunks).
    emulated = next(i for i, layout in enumerate(LAYOUTS) if "emulated" in layout["name"])
    plain_ep = next(i for i, layout in enumerate(LAYOUTS) if layout["name"] == "EP2 balanced")
    for rank in range(2):
        result = results[rank][emulated]
        ep_bytes, ep_messages = result["measured"]["ep"]
        assert result["exposed"]["ep"] >= ep_messages / 2 * 2e-3 + ep_bytes / 0.5e9, result["exposed"]
        assert {"ep", "dp"} <= set(results[rank][plain_ep]["exposed"])  # measured without emulation too
    # Under ZeRO-1 with TP the owners of the whole-matrix Muon gathers differ between DP ranks.
    zero1_tp = [results[rank][2]["measured"]["tp"] for rank in range(4)]
    assert zero1_tp[0] == zero1_tp[1] and zero1_tp[2] == zero1_tp[3] and zero1_tp[0] != zero1_tp[2]


def test_formula_terms_by_hand_and_refused_layouts():
    """The region terms for the debug model by hand: 8 mixers + 1 dense MLP + 7 shared-expert
    MLPs = 16 regions; N = b·s·h·4 bytes."""
    config = load_config(RECIPE, [])
    common = dict(micro_batch_size=1, seq_length=32, micro_batches=2)
    full = 1 * 32 * config.model.hidden_size * 4
    terms = {t.what.split(":")[0]: t for t in step_traffic_terms(config.model, config.optimizer, tp=2, **common)}
    assert terms["16 TP regions fwd"].bytes == 2 * 16 * full and terms["16 TP regions fwd"].messages == 32
    assert terms["vocab-parallel CE"].bytes == 2 * 3 * 32 * 4
    sp = {
        t.what.split(":")[0]: t
        for t in step_traffic_terms(config.model, config.optimizer, tp=2, sequence_parallel=True, **common)
    }
    assert sp["16 TP regions bwd"].bytes == 2 * 16 * (full + full // 2) and sp["16 TP regions bwd"].messages == 64
    assert predicted_step_traffic(config.model, config.optimizer, **common) == {}  # one process: nothing
    with pytest.raises(ValueError, match="pp=1 and ep=1"):
        predicted_step_traffic(config.model, config.optimizer, dp=2, pp=2, **common)
    with pytest.raises(ValueError, match="does not split"):
        predicted_step_traffic(
            config.model,
            config.optimizer,
            tp=2,
            sequence_parallel=True,
            micro_batch_size=1,
            seq_length=33,
            micro_batches=1,
        )


@pytest.mark.parametrize("tp,dp", [(1, 2), (1, 4), (2, 2)])
def test_zero1_reduce_scatters_gradients_at_distributed_optimizer_volume(tp, dp):
    """Under ZeRO-1 every gradient of the debug model reaches its owner by a reduce-scatter over
    `dp` (owner rows without padding, the rest pooled with its per-owner segments padded by at
    most 2.5%; TP-partial gradients then all-reduce only the owner's segment over `tp`), where
    without ZeRO-1 they are all-reduced: on a ring the gradients then cost (p-1)/p of the buffer
    instead of 2(p-1)/p, and gradients + parameter exchange about 1/1.5 of the all-reduce +
    all-gather they cost before (the old ZeRO-1)."""
    config = load_config(RECIPE, [])
    common = dict(micro_batch_size=1, seq_length=32, micro_batches=2, tp=tp, dp=dp)
    on = step_traffic_terms(config.model, config.optimizer, zero1=True, **common)
    off = step_traffic_terms(config.model, config.optimizer, zero1=False, **common)
    scattered = [t for t in on if t.group == "dp" and "reduce-scatter" in t.what]
    reduced = [t for t in off if t.group in ("dp", "data_tensor") and t.what.startswith("gradient buckets, all-reduce")]
    exchange = [t for t in on if t.group == "dp" and t.what.startswith("ZeRO-1 exchange")]
    assert scattered and reduced and len(exchange) == 1
    assert not any(t.what.startswith("gradient buckets, all-reduce") for t in on)
    plain = sum(t.bytes for t in reduced)  # the all-reduced buffers: every gradient + flags
    sent = sum(t.bytes for t in scattered)
    assert plain <= sent <= 1.025 * plain
    second = [t for t in on if t.group == "tp" and t.what.startswith("ZeRO-1: the owners' segments")]
    assert bool(second) == (tp > 1)  # the debug model has TP-partial gradients under TP
    wire_before = 2 * (dp - 1) / dp * plain + (dp - 1) * exchange[0].bytes
    wire_after = (dp - 1) / dp * sent + (dp - 1) * exchange[0].bytes
    assert wire_before / wire_after > 1.45  # 1.5 with no padding
    # The norm's share of the owner-only gradients: one fp32 scalar over the stage's dp × tp ranks.
    norm = [t for t in on if t.group == "data_tensor" and "owner-only" in t.what]
    assert [(t.bytes, t.messages) for t in norm] == [(4, 1)]
    assert not any("owner-only" in t.what for t in off)
