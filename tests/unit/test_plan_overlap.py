"""The planner's replay of the overlapped expert all-to-alls (`k3train/planning/overlap.py`),
against the schedule worked by hand, and its use in the step time."""

import pytest

from k3train.planning.overlap import exposed_expert_exchange_s, exposed_tensor_entry_s, exposed_tensor_leave_s


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


# ---- the overlapped TP entries (parallel/tensor_overlap.py), worked by hand


def test_one_piece_exposes_the_gather_and_hides_the_gradient_under_the_weight_gradients():
    # forward: the whole all-gather (1 s) before the GEMMs; backward: the input gradient (2 s),
    # its reduce-scatter (3 s) under the weight gradients (2 s): 1 s left
    assert exposed_tensor_entry_s(1.0, 3.0, 2.0, pieces=1) == pytest.approx(1.0 + 1.0)


def test_pieces_expose_the_first_gather_and_the_last_reduce():
    # 4 pieces: gathers of 0.25 s under 0.5 s GEMM pieces, only the first waited for; backward:
    # each 0.25 s reduce-scatter right after its 0.5 s input-gradient piece, all done under the
    # 2 s of weight gradients
    assert exposed_tensor_entry_s(1.0, 1.0, 2.0, pieces=4) == pytest.approx(0.25)


def test_wire_longer_than_the_pieces_leaves_the_difference():
    # 8 s of gather in 4 pieces of 2 s under 0.25 s GEMM pieces: the GEMMs wait for every piece
    # (8 s on the wire, 0.25 s after the last arrives, against 1 s of compute): 7.25 s
    forward_only = exposed_tensor_entry_s(8.0, 0.0, 1.0, pieces=4)
    assert forward_only == pytest.approx(8.0 + 0.25 - 1.0)


def test_without_sequence_parallelism_only_the_backward_all_reduce_counts():
    assert exposed_tensor_entry_s(0.0, 1.0, 2.0, pieces=1) == 0.0  # under 2 s of weight gradients
    assert exposed_tensor_entry_s(0.0, 5.0, 2.0, pieces=1) == pytest.approx(3.0)


def test_an_entry_needs_a_piece():
    with pytest.raises(ValueError, match="at least one piece"):
        exposed_tensor_entry_s(1.0, 1.0, 1.0, pieces=0)


# ---- the overlapped TP leaves, worked by hand


def test_one_leave_piece_exposes_its_reduce_and_gather():
    # forward: the 2 s GEMM, then its whole 1 s reduce-scatter; backward: the 0.5 s all-gather
    # before the input gradient, then the weight gradient (no collective left): 1.5 s
    assert exposed_tensor_leave_s(1.0, 0.5, 2.0, pieces=1) == pytest.approx(1.5)


def test_leave_pieces_expose_the_last_reduce_and_the_first_gather():
    # 4 pieces of 0.5 s GEMM: each 0.25 s reduce under the next piece, the last one exposed;
    # backward: the first 0.125 s gather piece waited for, the rest under 0.5 s input-gradient pieces
    assert exposed_tensor_leave_s(1.0, 0.5, 2.0, pieces=4) == pytest.approx(0.25 + 0.125)


def test_leave_wire_longer_than_its_pieces_leaves_the_difference():
    # 8 s of reduce in 4 pieces of 2 s after 0.25 s GEMM pieces: the link starts at 0.25 s and
    # carries 8 s, against 1 s of compute: 7.25 s; no backward collective without SP
    assert exposed_tensor_leave_s(8.0, 0.0, 1.0, pieces=4) == pytest.approx(0.25 + 8.0 - 1.0)


def test_a_leave_needs_a_piece():
    with pytest.raises(ValueError, match="at least one piece"):
        exposed_tensor_leave_s(1.0, 1.0, 1.0, pieces=0)


def _k3_step(*overrides: str):
    from k3train.config import load_config
    from k3train.parallel.pipeline_schedule import PipelinePlan
    from k3train.parallel.state import layout_of
    from k3train.planning.hardware import load_profile
    from k3train.planning.layout_traffic import overlapped_tensor_regions
    from k3train.planning.search import analytic_step_bytes
    from k3train.planning.time import estimate_step_time

    config = load_config("recipes/k3.yaml", list(overrides))
    layout = layout_of(1024, config.parallel, config.model)
    plan = PipelinePlan.from_config(config.model, config.parallel)
    entries = overlapped_tensor_regions(config, layout)
    step = estimate_step_time(
        config.model,
        layout,
        plan,
        load_profile("h200"),
        micro_batch_size=config.train.micro_batch_size,
        seq_length=config.data.seq_length,
        micro_batches=config.train.micro_batches_per_rank(layout.data_parallel),
        precision=config.train.precision,
        comm_bytes=analytic_step_bytes(config, layout, plan),
        ep_overlap_chunks=config.parallel.ep_overlap_chunks,
        ep_overlap_halves=config.parallel.ep_overlap_halves,
        tp_overlap=entries,
    )
    return entries, step


def test_the_planner_prices_overlapped_entries_only_for_torch_projections():
    # (the recipe runs torch projections in 8 pieces; the cases below set both explicitly)
    none, exposed = _k3_step("parallel.tp_overlap_chunks=0")
    assert none is None  # tp_overlap_chunks 0
    auto, on_te = _k3_step("parallel.tp_overlap_chunks=4", "model.linear_backend=auto")
    assert auto is None  # auto: Transformer Engine's projections on CUDA, which do not overlap
    assert on_te.exposed_comm_s["tp"] == exposed.exposed_comm_s["tp"]
    entries, overlapped = _k3_step("parallel.tp_overlap_chunks=4", "model.linear_backend=torch")
    assert entries is not None and entries.pieces == 4 and entries.reduce_bytes == 8 * entries.gather_bytes  # tp 8
    assert entries.leave_pieces == 4 and entries.leave_reduce_bytes == entries.reduce_bytes  # recompute attn_res
    assert entries.leave_gather_bytes == entries.gather_bytes
    # Hidden: at most the regions' bytes, at least something (the MLP GEMMs are long at K3's size).
    hidden = exposed.exposed_comm_s["tp"] - overlapped.exposed_comm_s["tp"]
    assert 0 < hidden < exposed.exposed_comm_s["tp"]
    assert overlapped.compute_s == exposed.compute_s
    # Under sublayer recompute the leaves stay unfused: less is hidden.
    sublayer, entries_only = _k3_step(
        "parallel.tp_overlap_chunks=4", "model.linear_backend=torch", "model.recompute=sublayer"
    )
    assert sublayer is not None and sublayer.leave_pieces == 0
    assert entries_only.exposed_comm_s["tp"] > overlapped.exposed_comm_s["tp"]


def test_entries_on_a_cpu_overlap_with_any_backend_and_without_sequence_parallelism():
    from k3train.config import load_config
    from k3train.parallel.state import layout_of
    from k3train.planning.layout_traffic import overlapped_tensor_regions

    config = load_config("recipes/debug.yaml", ["parallel.tp=2", "parallel.tp_overlap_chunks=3"])
    layout = layout_of(2, config.parallel, config.model)
    assert overlapped_tensor_regions(config, layout) is None  # auto on CUDA: TE
    entries = overlapped_tensor_regions(config, layout, device_type="cpu")
    assert entries is not None and entries.pieces == 1 and entries.gather_bytes == 0  # no SP: one all-reduce
    # the leaves' forward all-reduce in 3 pieces of the sequence, no backward collective
    assert entries.leave_pieces == 3 and entries.leave_reduce_bytes == entries.reduce_bytes
    assert entries.leave_gather_bytes == 0


# ---------------------------------------------------------------- alternating halves


def test_halves_hide_each_others_exchanges_worked_by_hand():
    # One MoE layer, one chunk: 1 s of work before the exchange, 2 s of experts, 8 s of wire
    # (1 s per half, hop and direction). Forward: A's dispatch (0.5-1.5) under B's mixer, which
    # then waits for the link (B's loads all-gather) until 1.5; B's dispatch (1.5-2.5) under A's
    # experts (1.5-2.5), A's combine (2.5-3.5) under B's experts, B's combine (3.5-4.5) exposed:
    # end 4.5 - 3 s of compute = 1.5. Backward (2x compute, mirrored): B's and A's combine
    # gradients on the link 0-1 and 1-2, B's expert backward 1-3, B's dispatch gradient 3-4 under
    # A's expert backward 3-5, A's dispatch gradient 5-6 under B's mixer backward 5-6, A's
    # mixer backward 6-7: end 7 - 6 = 1.
    from k3train.planning.overlap import LayerWork, exposed_alternating_halves_s

    layer = LayerWork(before_s=1.0, exchange_s=8.0, experts_s=2.0, shared_s=0.0)
    assert exposed_alternating_halves_s([layer], chunks=1) == pytest.approx(2.5)
    # without overlap all 8 s wait; chunks alone (no halves) cannot hide under the mixer
    assert exposed_expert_exchange_s(8.0, 2.0, 0.0, chunks=1) == pytest.approx(8.0)


def test_halves_with_nothing_to_hide_behind_expose_the_wire():
    from k3train.planning.overlap import LayerWork, exposed_alternating_halves_s

    idle = LayerWork(before_s=0.0, exchange_s=8.0, experts_s=0.0, shared_s=0.0)
    assert exposed_alternating_halves_s([idle, idle], chunks=2) == pytest.approx(16.0)


def test_dense_layers_cover_the_last_combine_of_the_layer_before():
    # the second half's last combine travels while the first half runs its next (dense) layer
    from k3train.planning.overlap import LayerWork, exposed_alternating_halves_s

    moe = LayerWork(before_s=1.0, exchange_s=8.0, experts_s=2.0, shared_s=0.0)
    alone = exposed_alternating_halves_s([moe], chunks=1)
    followed = exposed_alternating_halves_s([moe, LayerWork(before_s=4.0)], chunks=1)
    assert followed < alone
    with pytest.raises(ValueError, match="chunks >= 1"):
        exposed_alternating_halves_s([moe], chunks=0)


def test_the_planner_prices_the_halves_below_the_chunks_alone():
    _, chunks_only = _k3_step()
    _, halves = _k3_step("parallel.ep_overlap_halves=true", "train.micro_batch_size=2", "train.global_batch_size=4096")
    _, chunks_mb2 = _k3_step("train.micro_batch_size=2", "train.global_batch_size=4096")
    assert halves.exposed_comm_s["ep"] < chunks_mb2.exposed_comm_s["ep"]
    assert halves.compute_s == chunks_mb2.compute_s and chunks_only.exposed_comm_s["ep"] > 0
