"""Expert parallelism reproduces the single-process loss and gradients (gloo, CPU, float64).

Two launches (2 and 4 ranks) run every check. Layouts: EP2, EP4 and EP2×DP2 (ep carved out of
dp), EP2 with TP2 and sequence parallelism (2 and 4 ranks), EP2 inside PP2 stages with two
micro-batches per DP rank; `balanced` mode (transports `relay`, `spread`, `padded`, `splits` and
`exact`;
replicas planned per micro-batch, `online`, the default, or per step), `capacity` mode with a
capacity that drops nothing
(`C_pair = s·k`), and `capacity` mode with a small capacity, where the reference model drops, per
source rank, the slots a plain-Python reference of the drop policy picks, and the EP model must
drop exactly those. The gate bias favours the first EP rank's experts so that `balanced` mode
has to replicate (asserted). Gradients are reduced by parallel/grad_reduce.py's GradientReducer
(expert parameters over `state.expert_dp`).

Tolerance: float64; the EP model sums the same products in another order (the combine adds a
token's k outputs in slot order, the reference per expert), so differences are a few ulps:
1e-12 absolute on the loss (≈ 6) and on every gradient (O(1e-2)); observed ≤ 5e-16 and, for
expert gradients, ≤ 5e-18. The routing bias for the next step (Quantile Balancing histogram,
combined over `routing_statistics_group`) and the step's per-expert loads must match exactly.

The static-shape check runs a whole EP MoE layer (planner, dispatch, replica exchange, local
experts on the static gather path, combine, and backward) under a dispatch mode that fails on
any device-to-host read or data-dependent shape, for four very different routings, and requires
identical op traces and exchanged buffer shapes equal to `ExpertParallel.buffer_shapes`.

The dispatcher-alone checks route every token to the same top-k experts from the first
micro-batch (then switch them), and give some sources their own hot experts; with the TE
stand-in (`tests/unit/te_stand_in.py`, whose GroupedLinear refuses a splits list of another
length than its GEMMs, as TE does) the home and replica GEMMs run through `kernels/te.py`.
Their gradient tolerance is the same 1e-12 absolute (observed ≤ 3e-14 on O(10) sums over 64
tokens).
"""

import pytest

from tests.distributed.harness import run_workers

TOLERANCE = 1e-12
TARGET = "tests.distributed.workers_expert:run_checks"


def balanced(ep, **extra):  # the default configuration
    return {"check": "equivalence", "ep": ep, "mode": "balanced", "capacity_factor": 1.25, "skew": 0.05, **extra}


def no_drop(ep, **extra):
    return {"check": "equivalence", "ep": ep, "mode": "capacity", "capacity_factor": float(ep), "skew": 0.05, **extra}


def dropping(ep, capacity_factor, **extra):
    return {
        "check": "equivalence",
        "ep": ep,
        "mode": "capacity",
        "capacity_factor": capacity_factor,
        "skew": 0.05,
        **extra,
    }


SP = {"tp": 2, "sequence_parallel": True}
TE = {"linear_backend": "te"}  # the experts' GEMMs through kernels/te.py on the CPU stand-in of TE
STEP_TOP_UP = {"replica_planning": "step", "top_up": 2}  # step replicas, topped up per micro-batch
PP = {"check": "pipeline", "pp": 2, "config": {"num_hidden_layers": 4}, "micro_batches": 2}

CHECKS = {
    2: [
        balanced(2),
        no_drop(2),
        dropping(2, 0.5),
        balanced(2, config={"recompute": "sublayer"}),  # MoE forward recomputed in backward
        balanced(2, **SP),
        no_drop(2, **SP),
        dropping(2, 0.5, **SP),
        {"check": "static_shapes", "mode": "balanced", "capacity_factor": 1.25},
        {"check": "static_shapes", "mode": "balanced", "capacity_factor": 1.25, "transport": "padded"},
        {"check": "static_shapes", "mode": "capacity", "capacity_factor": 1.25},
        balanced(2, transport="padded"),
        balanced(2, transport="splits"),
        {"check": "skewed_sources"},
        {"check": "skewed_sources", "transport": "padded"},
        {"check": "skewed_sources", "transport": "splits"},
        {"check": "skewed_sources", "replica_planning": "step"},
        balanced(2, replica_planning="step"),
        {"check": "static_shapes", "mode": "balanced", "capacity_factor": 1.25, "replica_planning": "step"},
        {"check": "concentrated_routing"},
        {"check": "concentrated_routing", **TE},
        {"check": "concentrated_routing", **TE, "fp8": True},
        {"check": "static_shapes", "mode": "balanced", "capacity_factor": 1.25, "transport": "spread"},
        balanced(2, transport="spread"),
        {"check": "skewed_sources", "replica_planning": "step", **TE},
        # the overlapped schedule (tokens in chunks, all-to-alls in flight under other chunks'
        # experts and the shared experts): the same losses and gradients
        balanced(2, overlap_chunks=2),
        balanced(2, overlap_chunks=3, transport="spread"),
        balanced(2, overlap_chunks=2, transport="splits", **SP),
        balanced(2, overlap_chunks=2, replica_planning="step", config={"recompute": "sublayer"}),
        # each micro-batch in two halves whose layers alternate at the MoE exchanges
        # (three sequences per rank: halves of two and one, the block keys split at the same row)
        balanced(2, overlap_chunks=2, overlap_halves=True, transport="spread", batch=6),
        balanced(2, overlap_chunks=2, overlap_halves=True, transport="splits", **SP),
        # `exact`: the rows that exist, fixed buffers, counts as tensors
        balanced(2, transport="exact"),
        {"check": "static_shapes", "mode": "balanced", "capacity_factor": 1.25, "transport": "exact"},
        {"check": "concentrated_routing", "transport": "exact", **TE},
        # `step` replicas topped up per micro-batch where the placement falls short
        {"check": "concentrated_routing", "transport": "exact", "replica_planning": "step", "top_up": 3, **TE},
        {"check": "static_shapes", "mode": "balanced", "capacity_factor": 1.25, "transport": "exact", **STEP_TOP_UP},
    ],
    4: [
        balanced(4),
        no_drop(4),
        dropping(4, 0.75),
        balanced(2),  # EP2 × DP2: two EP groups, expert grads reduced over expert_dp
        no_drop(2),
        dropping(2, 0.5),
        balanced(2, **SP),  # TP2 × DP2, EP2 = the TP ranks
        balanced(4, **SP),  # EP4 over TP2 × DP2
        {**balanced(2), **PP},
        {**no_drop(2), **PP},
        balanced(4, transport="padded"),
        balanced(4, transport="splits"),
        {"check": "static_shapes", "mode": "balanced", "capacity_factor": 1.25},
        {"check": "skewed_sources"},
        {"check": "skewed_sources", "transport": "padded"},
        {"check": "skewed_sources", "transport": "splits"},
        {"check": "skewed_sources", "replica_planning": "step"},
        {"check": "skewed_sources", "transport": "padded", "replica_planning": "step"},
        balanced(4, replica_planning="step"),
        # EP2 × expert_dp 2, two micro-batches: the replicas' gradients accumulate, return home in
        # the last backward and are reduced over expert_dp with the home gradients
        balanced(2, replica_planning="step", micro_batches=2),
        {**balanced(2), **PP, "replica_planning": "step"},
        {"check": "concentrated_routing"},
        {"check": "concentrated_routing", "transport": "spread"},
        {"check": "concentrated_routing", "transport": "spread", **TE},
        {"check": "skewed_sources", "transport": "spread"},
        balanced(4, transport="spread"),
        {"check": "node_dedup", "gpus_per_node": 2},
        {"check": "node_dedup", "gpus_per_node": 2, **TE},
        {"check": "node_dedup", "gpus_per_node": 2, **STEP_TOP_UP},
        {"check": "static_shapes", "mode": "balanced", "capacity_factor": 1.25, "transport": "nodes"},
        {"check": "concentrated_routing", "transport": "nodes", **STEP_TOP_UP},
        {"check": "concentrated_routing", "transport": "padded"},
        {"check": "concentrated_routing", "transport": "splits"},
        {"check": "concentrated_routing", "replica_planning": "step"},
        balanced(4, overlap_chunks=2, transport="splits"),
        # TP2 × EP2 (spread: relay's per-chunk buffers are smaller, and this skew overflows them)
        balanced(2, overlap_chunks=2, transport="spread", **SP),
        {**balanced(2), **PP, "overlap_chunks": 2, "transport": "splits"},  # PP2 × EP2
        balanced(2, overlap_chunks=2, replica_planning="step", micro_batches=2, transport="splits"),
        balanced(4, transport="exact"),
        {"check": "skewed_sources", "transport": "exact"},
        {"check": "concentrated_routing", "transport": "exact"},
        {**balanced(2), **PP, "overlap_chunks": 2, "transport": "exact"},  # PP2 × EP2, overlapped
        {"check": "static_shapes", "mode": "balanced", "capacity_factor": 1.25, "transport": "exact"},
        {"check": "concentrated_routing", "transport": "exact", **STEP_TOP_UP},
        {"check": "skewed_sources", "transport": "exact", **STEP_TOP_UP},
        balanced(2, replica_planning="step", top_up=2, micro_batches=2, transport="exact"),  # EP2 × expert_dp 2
        {**balanced(2), **PP, "overlap_chunks": 2, "transport": "exact", **STEP_TOP_UP},
        # halves alternating: TP2 × EP2 and PP2 × EP2 (two micro-batches of two sequences per stage)
        balanced(2, overlap_chunks=2, overlap_halves=True, transport="spread", **SP),
        {**balanced(2), **PP, "overlap_chunks": 2, "overlap_halves": True, "transport": "splits"},
        {**balanced(2), **PP, "overlap_chunks": 2, "overlap_halves": True, "transport": "exact", **STEP_TOP_UP},
    ],
}


def name(spec):
    parts = [spec["check"], spec.get("mode", ""), spec.get("transport", ""), spec.get("replica_planning", "")]
    if spec.get("top_up"):
        parts.append(f"top-up{spec['top_up']}")
    parts.append(spec.get("linear_backend", "") + (" fp8" if spec.get("fp8") else ""))
    for key in ("ep", "tp", "pp"):
        if spec.get(key, 1) > 1:
            parts.append(f"{key}{spec[key]}")
    parts.append(f"cf{spec.get('capacity_factor', 1.25)}")
    if spec.get("overlap_chunks"):
        parts.append(f"overlap{spec['overlap_chunks']}")
    if spec.get("overlap_halves"):
        parts.append("halves")
    if spec.get("config"):
        parts.append(str(spec["config"]))
    return " ".join(parts)


def check_equivalence(spec, rank, result):
    label = (name(spec), rank)
    assert abs(result["loss"] - result["reference_loss"]) < TOLERANCE, (label, result["loss"], result["reference_loss"])
    assert result["max_grad_error"] < TOLERANCE, (label, result["worst_param"], result["max_grad_error"])
    assert result["expert_params_checked"] >= 3 and result["checked"] > 40, label
    assert result["bias_error"] < TOLERANCE and result["load_matches"], (label, result["bias_error"])
    # `overlap_halves`: every MoE layer dispatched each micro-batch as two halves
    calls = (2 if spec.get("overlap_halves") else 1) * spec.get("micro_batches", 1)
    assert set(result["dispatch_calls"]) == {calls}, (label, result["dispatch_calls"])
    layers = result["layers"].values()
    if spec["mode"] == "balanced" or spec["capacity_factor"] >= spec["ep"]:
        assert all(layer["dropped"] == 0 for layer in layers), (label, result["layers"])
    if spec["mode"] == "balanced":  # the skew makes the planner replicate, and it helps
        assert all(layer["replicas"] > 0 for layer in layers), (label, result["layers"])
        assert all(max(layer["rank_load"]) < max(layer["load_before"]) for layer in layers), label
    if spec["mode"] == "capacity" and spec["capacity_factor"] < spec["ep"]:
        assert all(
            layer["keep_mismatches"] == 0 and layer["dropped"] == layer["reference_dropped"] > 0 for layer in layers
        ), (label, result["layers"])


def check_static(spec, result):
    assert result["identical"], (name(spec), result["first_difference"])
    expected = result["expected_shapes"]
    for kind, shape in result["exchanges"]:
        if kind == "all_gather":
            assert (spec["mode"], shape) == ("balanced", (1, expected["slot_counts"][1]))
        elif kind == "counted_all_to_all":  # `exact`: fixed send and receive buffers, either way
            # and the replica fetch: [R·M, F] out, [M, F] in (`online`, or the top-ups after `step`'s)
            ranks, slots, width = expected["top_up_weights" if spec.get("top_up") else "replica_weights"]
            fixed = (
                expected["dispatch"],
                expected["dispatch_ids"],
                expected["received"],
                expected["received"][:1],
                (ranks * slots, width),
                (slots, width),
            )
            # (`nodes`: its hops' own fixed buffers, (token, node) rows and forwarded pairs: the
            # identical traces under four routings are its check)
            assert spec.get("transport") == "nodes" or all(buffer in fixed for buffer in shape), shape
        elif spec.get("transport") == "nodes" and shape == (expected["slot_counts"][0],):
            pass  # a hop's `[R]` row counts, exchanged before its rows
        else:
            assert shape in (
                expected["dispatch"],
                expected["dispatch_ids"],
                expected.get("forward"),
                expected.get("forward_ids"),
                expected.get("replica_weights"),
                expected.get("top_up_weights"),
            ), shape
    if spec["mode"] == "balanced":
        assert any(facts["replicas"] > 0 for facts in result["facts"].values())


def check_skewed_sources(spec, result, world_size):
    """Per-source hot experts on some ranks only: the old per-pair layout would overflow (a home
    pair above C_pair). Replicas planned per micro-batch (`online`, the default) are there from
    step 0; with `step` planning (replicas from the previous step's loads) step 0 has none and
    may drop, counted. The per-destination layouts (`padded`, `splits`, `exact`) then drop nothing (from
    step 0 `online`, from step 1 `step`), and the `relay` transport neither on 2 ranks, while on
    4 ranks this skew (balanced destinations, but not balanced pairs) (a source sending up to ~77% of its slots to one rank's experts,
    64 tokens) is past its boundary (3 relays of `C2` rows cannot forward a pair's overflow within
    1.25× of the wire; docs/expert_parallel.md) and it drops, counted (measured: 95 and 86 of
    1,024 slots after step 0). Outputs (a dropped slot weighs zero) and home gradients match one
    process in every case."""
    label = (name(spec), result)
    assert result["max_home_pair"] > result["pair_capacity"], label
    online = spec.get("replica_planning", "online") == "online" or bool(spec.get("top_up"))
    if online:  # (top-ups: step 0's replicas are all top-ups)
        assert all(replicas > 0 for replicas in result["replicas"]), label
    else:
        assert result["replicas"][0] == 0 and result["replicas"][-1] > 0, label
    if spec.get("transport", "relay") == "relay" and world_size > 2:  # past the relay's pair bound
        assert all(dropped > 0 for dropped in result["dropped"]), label
    else:
        assert result["dropped"][0 if online else 1 :] == [0, 0, 0][0 if online else 1 :], label
    assert result["output_error"] < TOLERANCE and result["grad_error"] < TOLERANCE, label


def check_node_dedup(spec, results):
    """`nodes` on 4 ranks as 2 nodes of 2: outputs and gradients (experts and routing weights) as
    one process; the bytes counted between nodes (summed over the ranks, who send them) are
    exactly one row per (token, remote node), fewer than one per slot with a remote expert."""
    for result in results:
        label = (name(spec), result)
        assert result["dropped"] == 0 and result["replicas"] > 0, label
        errors = (result["output_error"], result["grad_error"], result["weight_grad_error"])
        assert max(errors) < TOLERANCE, label
    rows = sum(result["remote_rows"] for result in results)
    assert sum(result["internode_bytes"] for result in results) == rows * results[0]["bytes_per_remote_row"]
    assert 0 < rows < sum(result["remote_slots"] for result in results)


def check_te_calls(spec, result):
    """With the TE stand-in, both the home and the replica GEMMs ran through GroupedLinear (whose
    stand-in, as TE, refuses a splits list whose length is not its number of GEMMs)."""
    if spec.get("linear_backend") == "te":
        calls = result["te_calls"]
        assert calls["home"] > 0 and calls["replica"] > 0, (name(spec), result)
        # inside the FP8 region every GEMM ran in FP8 (groups padded to 16 rows, as TE requires)
        assert calls["fp8"] == (calls["home"] + calls["replica"] if spec.get("fp8") else 0), (name(spec), result)


def check_concentrated(spec, result):
    """Every token on every rank picks the same top-k experts (all homed on the first rank), from
    the first micro-batch, then all switch to the last rank's: with `online` replicas nothing is
    dropped and the outputs and home gradients match one process; `step` replicas (none in the
    first step, the wrong ones after the switch) drop, and count it (the outputs then differ from
    the undropped reference, which is why they are not compared), unless topped up per
    micro-batch (`top_up`): then nothing is dropped either."""
    label = (name(spec), result)
    if spec.get("replica_planning", "online") == "online" or spec.get("top_up"):
        assert result["dropped"] == [0, 0] and all(r > 0 for r in result["replicas"]), label
        assert result["output_error"] < TOLERANCE and result["grad_error"] < TOLERANCE, label
    else:
        assert all(dropped > 0 for dropped in result["dropped"]), label


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_matches_single_process(world_size):
    checks = CHECKS[world_size]
    results = run_workers(world_size, TARGET, checks, timeout_s=240)
    for index, spec in enumerate(checks):
        if spec["check"] == "node_dedup":
            check_node_dedup(spec, [per_rank[index] for per_rank in results])
    for rank, per_rank in enumerate(results):
        for spec, result in zip(checks, per_rank):
            if spec["check"] == "node_dedup":
                continue
            if spec["check"] == "static_shapes":
                check_static(spec, result)
            elif spec["check"] == "skewed_sources":
                check_skewed_sources(spec, result, world_size)
                check_te_calls(spec, result)
            elif spec["check"] == "concentrated_routing":
                check_concentrated(spec, result)
                check_te_calls(spec, result)
            else:
                check_equivalence(spec, rank, result)
    summary = {
        name(spec): (
            max(r[i].get("max_grad_error", 0.0) for r in results),
            sum(layer.get("dropped", 0) for r in results for layer in r[i].get("layers", {}).values()),
        )
        for i, spec in enumerate(checks)
    }
    print(summary)
