"""The planner's replay of the overlapped expert all-to-alls (`k3train/planning/overlap.py`),
against the schedule worked by hand, and its use in the step time."""

import pytest

from k3train.planning.overlap import exposed_expert_exchange_s


def test_no_overlap_exposes_everything():
    assert exposed_expert_exchange_s(4.0, 100.0, 10.0, chunks=0) == 4.0


def test_no_compute_hides_nothing():
    # nothing to run under the wire: the layer waits for every byte
    assert exposed_expert_exchange_s(4.0, 0.0, 0.0, chunks=4) == pytest.approx(4.0)


def test_one_chunk_without_shared_experts_hides_nothing():
    # dispatch (1 s) before the experts, combine (1 s) after them, each way
    assert exposed_expert_exchange_s(4.0, 100.0, 0.0, chunks=1) == pytest.approx(4.0)


def test_shared_experts_cover_the_first_dispatch_and_the_last_dispatch_gradient():
    # forward: the dispatch under the shared experts, the combine exposed; backward: the
    # combine gradient exposed, the dispatch gradient under the shared experts' backward
    assert exposed_expert_exchange_s(4.0, 100.0, 10.0, chunks=1) == pytest.approx(2.0)


def test_chunks_leave_one_combine_exposed_each_way():
    # 4 chunks of 0.25 s per hop and direction: only the last combine (forward) and the first
    # combine gradient (backward) wait, while the experts are long enough to cover the rest
    assert exposed_expert_exchange_s(4.0, 100.0, 10.0, chunks=4) == pytest.approx(0.5)


def test_wire_longer_than_compute_exposes_the_difference():
    # 40 s on the wire, 2 s of experts forward (4 s backward), no shared experts: the link is the
    # bottleneck, so the exposed time is the wire time not covered by compute
    exposed = exposed_expert_exchange_s(40.0, 2.0, 0.0, chunks=4)
    assert 40.0 - 6.0 <= exposed < 40.0
