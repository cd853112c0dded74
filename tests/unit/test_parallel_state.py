"""Layouts: the documented rank order, every group, and one clear message for each impossible layout."""

import pytest

from k3train.parallel.config import ModelSplitSizes
from k3train.parallel.state import Layout, LayoutError, ParallelState, resolve_layout

DEBUG = dict(mla_heads=4, kda_heads=4, vocab_size=384, num_experts=16, num_layers=8)


def resolve(world, tp=1, pp=1, dp=0, ep=1, virtual_stages=1, **model):
    sizes = {**DEBUG, **model}
    return resolve_layout(world, tp, pp, dp, ep, virtual_stages, ModelSplitSizes(**sizes))


def test_rank_order_is_tp_fastest_then_dp_then_pp():
    layout = resolve(8, tp=2, pp=2, ep=2)
    assert layout.dp == 2
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.data_tensor_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.model_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # Expert parallelism carved out of dp×tp within a stage; expert-data groups are the rest.
    assert layout.ep_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.expert_dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for rank in range(8):
        tp_rank, dp_rank, pp_rank = layout.coordinates(rank)
        assert layout.rank_of(tp_rank, dp_rank, pp_rank) == rank


def test_every_rank_is_in_exactly_one_group_of_each_kind():
    layout = resolve(16, tp=2, pp=2, ep=4)
    for groups in (
        layout.tp_groups(),
        layout.dp_groups(),
        layout.pp_groups(),
        layout.ep_groups(),
        layout.expert_dp_groups(),
        layout.data_tensor_groups(),
        layout.model_groups(),
    ):
        assert sorted(rank for group in groups for rank in group) == list(range(16))


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(world=6, tp=4), "world size 6 is not divisible by tp*pp"),
        (dict(world=4, tp=1, dp=3), "parallel.dp=3"),
        (dict(world=3, tp=3), "num_attention_heads (MLA heads)=4 is not divisible by parallel.tp=3"),
        (dict(world=2, tp=2, kda_heads=3), "linear_attn_config.num_heads (KDA heads)=3"),
        (dict(world=2, tp=2, vocab_size=385), "model.vocab_size=385"),
        (dict(world=4, ep=3), "model.num_experts=16 is not divisible by parallel.ep=3"),
        (dict(world=4, ep=8), "parallel.ep=8 must divide dp*tp"),
        (dict(world=4, pp=4, virtual_stages=3), "cannot fill pp*virtual_stages"),
    ],
)
def test_impossible_layouts_name_the_sizes_and_what_fits(kwargs, expected):
    world = kwargs.pop("world")
    with pytest.raises(LayoutError) as error:
        resolve(world, **kwargs)
    message = str(error.value)
    assert expected in message and "\n" not in message
    assert any(word in message for word in ("fit", "one of", "choose", "use", "set", "must divide"))


def test_single_process_state_has_identity_groups():
    state = ParallelState.single()
    assert state.layout == Layout(1, 1, 1, 1, 1)
    for group in (
        state.tp,
        state.dp,
        state.pp,
        state.pp_grad,
        state.ep,
        state.expert_dp,
        state.data_tensor,
        state.model,
    ):
        assert group.size == 1 and group.process_group is None
