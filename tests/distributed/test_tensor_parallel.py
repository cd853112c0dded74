"""Tensor and sequence parallelism reproduce the single-process loss and gradients (gloo, CPU).

Tolerance: float64 throughout; the TP model computes the same products but sums partial results
over ranks in a different order, so differences are a few ulps of the values involved:
1e-12 absolute on the loss (≈ 6) and on gradients (O(1e-2)).
"""

import pytest

from tests.distributed.harness import run_workers

TOLERANCE = 1e-12


@pytest.mark.parametrize(
    "tp,sequence_parallel,overlap_chunks",
    [(2, False, 0), (2, True, 0), (2, True, 3), (2, False, 2)],
    ids=["tp", "tp+sp", "tp+sp, every entry and leave overlapped in 3 pieces", "tp, entries and leaves overlapped"],
)
def test_tensor_parallel_matches_single_process(tp, sequence_parallel, overlap_chunks):
    """`parallel.tp_overlap_chunks` > 0: every mixer and MLP entry fused with its projections, every
    leave with its row-parallel projection
    (parallel/tensor_overlap.py); the same sums in another order, within the same 1e-12."""
    results = run_workers(
        tp,
        "tests.distributed.workers_tp:compare_one_step",
        {"tp": tp, "sequence_parallel": sequence_parallel, "tp_overlap_chunks": overlap_chunks},
        timeout_s=240,
    )
    for rank, result in enumerate(results):
        assert abs(result["loss"] - result["reference_loss"]) < TOLERANCE, (rank, result)
        assert result["max_grad_error"] < TOLERANCE, (rank, result["worst_param"], result["max_grad_error"])
        assert result["checked"] > 50
    print({rank: (r["max_grad_error"], r["traffic"]) for rank, r in enumerate(results)})


@pytest.mark.parametrize("tp,sequence_parallel", [(2, True)])
def test_tensor_parallel_optimizer_steps_match_single_process(tp, sequence_parallel):
    """Three Per-Head Muon + AdamW steps: 1e-10 (Newton–Schulz amplifies the ulp-level gradient
    differences a little over three steps; a wrong per-shard orthogonalisation is off by O(lr))."""
    results = run_workers(
        tp,
        "tests.distributed.workers_tp:compare_three_steps",
        {"tp": tp, "sequence_parallel": sequence_parallel},
        timeout_s=240,
    )
    for rank, result in enumerate(results):
        assert result["max_param_error"] < 1e-10, (rank, result)
        assert result["bias_error"] < 1e-10, (rank, result)


def test_fused_entry_and_leave_overlap_equal_the_unfused_regions():
    """The overlapped entry and leave (parallel/tensor_overlap.py) compute the same sums in another
    order (pieces of the sequence, input gradients summed over the projections before the
    collective, partial products summed per piece): 1e-12 in float64 on values O(1) from sums of
    4 to 20 products; the same bytes on the wire."""
    results = run_workers(2, "tests.distributed.workers_tp:compare_fused_entry", {}, timeout_s=240)
    for rank, cases in enumerate(results):
        assert len(cases) == 12 and sum(bool(case.get("leave")) for case in cases) == 6
        for case in cases:
            assert case["error"] < TOLERANCE, (rank, case)
            assert case["bytes"][0] == case["bytes"][1] > 0, (rank, case)
