"""Initialisation at scale: each rank draws only bounded tiles of its own shard, and the values
do not depend on the layout (tensor-parallel shards, expert-parallel stacks) or on the tile size
for tensors of at most one tile."""

import dataclasses
from types import SimpleNamespace
from typing import cast

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3train.model.config import ModelConfig
from k3train.model.initialization import TiledStream, normal_fill, stream_seed
from k3train.model.k3 import K3ModelChunk
from k3train.model.kda import KimiDeltaAttention
from k3train.parallel.comm import Group, TrafficCounter
from k3train.parallel.expert import ExpertParallel
from k3train.parallel.tensor import ShardedParameter

TINY_TILE = 64  # elements: every debug-model matrix spans many tiles


def unbounded_gate_config() -> ModelConfig:
    base = ModelConfig()
    return dataclasses.replace(
        base, linear_attn_config=dataclasses.replace(base.linear_attn_config, gate_lower_bound=None)
    )


def tp_rank_model(config: ModelConfig, tp: int, rank: int, ep: int = 1) -> K3ModelChunk:
    """The model TP rank `rank` of `tp` (and EP rank `rank % ep` of `ep`) builds, in one process
    (no collective runs while building and initialising)."""
    parallel = SimpleNamespace(
        tp=Group("tp", tuple(range(tp)), rank, None, TrafficCounter()),
        sequence_parallel=False,
        tp_overlap_chunks=0,
        cp=Group("cp", (0,), 0, None, TrafficCounter()),
    )
    expert_parallel = None
    if ep > 1:
        expert_parallel = ExpertParallel(
            Group("ep", tuple(range(ep)), rank % ep, None, TrafficCounter()), config.num_experts, "capacity", 1.0
        )
    return K3ModelChunk(config, parallel=parallel, expert_parallel=expert_parallel)


def reassembled(shards: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if getattr(like, "tensor_parallel", False):
        return torch.cat(shards, dim=cast(ShardedParameter, like).partition_dim)
    if getattr(like, "expert_parallel", False):
        return torch.cat(shards, dim=0)
    assert all(torch.equal(shard, shards[0]) for shard in shards)  # replicated
    return shards[0]


@pytest.mark.parametrize(
    "config, tp, ep",
    [(ModelConfig(), 2, 1), (unbounded_gate_config(), 4, 2)],
    ids=["tp2-bounded-gate", "tp4-ep2-unbounded-gate"],
)
def test_shards_drawn_in_tiny_tiles_reassemble_to_the_one_process_tensor(config, tp, ep):
    whole = K3ModelChunk(config)
    whole.init_weights(seed=7, tile_elements=TINY_TILE)
    ranks = [tp_rank_model(config, tp, rank, ep) for rank in range(tp)]
    for model in ranks:
        model.init_weights(seed=7, tile_elements=TINY_TILE)
    shards = [dict(model.named_parameters()) for model in ranks]
    sharded_names = 0
    for name, expected in whole.named_parameters():
        like = shards[0][name]
        pieces = [params[name].detach() for params in shards]
        if getattr(like, "expert_parallel", False):
            pieces = pieces[:ep]  # TP ranks beyond ep repeat the same experts
        sharded_names += getattr(like, "tensor_parallel", False)
        assert torch.equal(reassembled(pieces, like), expected.detach()), name
    assert sharded_names > 20  # lm_head, embedding, projections, convolutions, gates


def test_tensors_of_one_tile_keep_the_whole_tensor_draw_and_larger_ones_are_tiled():
    default, tiny = K3ModelChunk(ModelConfig()), K3ModelChunk(ModelConfig())
    default.init_weights(seed=3)
    tiny.init_weights(seed=3, tile_elements=TINY_TILE)
    tiny_params = dict(tiny.named_parameters())
    for name, param in default.named_parameters():
        random = not (name.endswith("norm.weight") or name.endswith("_res.proj.weight") or name.endswith("A_log"))
        rows = param[0] if name.split(".")[-1] in ("w1", "w2", "w3") else param  # experts: one stream each
        if param.numel() and random and rows.numel() > TINY_TILE:
            assert not torch.equal(param, tiny_params[name]), name
            first_tile = max(1, TINY_TILE // rows[0].numel())  # tile 0 has the seed of the whole draw
            assert not torch.equal(rows[:first_tile], rows[first_tile : 2 * first_tile])
        elif param.numel() <= TINY_TILE:
            assert torch.equal(param, tiny_params[name]), name


def test_tile_zero_is_the_whole_tensor_draw_and_shards_cut_tiles():
    stream = TiledStream(11, "w", (10, 6), normal_fill(0.5), tile_elements=24)  # tiles of 4 rows
    assert stream.tile_rows == 4
    whole = torch.empty(10, 6)
    stream.draw_into(whole)
    one_draw = torch.empty(4, 6).normal_(0.0, 0.5, generator=torch.Generator().manual_seed(stream_seed(11, "w")))
    assert torch.equal(whole[:4], one_draw)
    assert not torch.equal(whole[4:8], one_draw)  # tile 1 has its own seed
    middle = torch.empty(5, 3)  # rows 3..7, right half: parts of two tiles
    stream.draw_into(middle, first_row=3, parts=2, part=1, dim=1)
    assert torch.equal(middle, whole[3:8, 3:])
    with pytest.raises(ValueError, match="outside"):
        stream.draw_into(torch.empty(4, 6), first_row=8)


class LargestAllocation(TorchDispatchMode):
    """The largest tensor any operator allocates (views and in-place results excluded)."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.existing = {tensor.untyped_storage().data_ptr() for tensor in existing}
        self.largest, self.operator = 0, None
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for output in outputs:
            if (
                isinstance(output, torch.Tensor)
                and not output._is_view()
                and output.untyped_storage().data_ptr() not in self.existing
            ):
                self.shapes.add(tuple(output.shape))
                if output.numel() > self.largest:
                    self.largest, self.operator = output.numel(), func
        return result


@pytest.mark.parametrize("config", [ModelConfig(), unbounded_gate_config()], ids=["bounded", "unbounded"])
def test_a_tp_rank_allocates_at_most_one_tile(config):
    model = tp_rank_model(config, tp=2, rank=1)
    SMALL_TILE = 1024  # elements: larger than any row, far smaller than the head (fewer ops to watch)
    params = list(model.parameters())
    lm_head = model.lm_head.weight
    assert lm_head.full_shape == (config.vocab_size, config.hidden_size)
    longest_row = max(param[0].numel() if param.dim() > 1 else 1 for param in params)
    bound = max(SMALL_TILE, longest_row)
    with LargestAllocation(params) as recorder:
        model.init_weights(seed=7, tile_elements=SMALL_TILE)
    assert 0 < recorder.largest <= bound < lm_head.numel(), (recorder.largest, recorder.operator)
    # and the values are the one-process model's slice
    whole = K3ModelChunk(config)
    whole.init_weights(seed=7, tile_elements=SMALL_TILE)
    assert torch.equal(lm_head, whole.lm_head.weight.chunk(2, 0)[1])
    assert torch.equal(
        model.layers["1"].self_attn.o_proj.weight, whole.layers["1"].self_attn.o_proj.weight.chunk(2, 1)[1]
    )


def test_kda_gate_is_initialised_once_from_its_stream():
    config = unbounded_gate_config()
    whole = KimiDeltaAttention(config)
    whole.reset_gate_parameters(seed=5, key="layers.0.self_attn", tile_elements=3)
    again = KimiDeltaAttention(config)
    again.reset_gate_parameters(seed=5, key="layers.0.self_attn")
    assert torch.all(whole.A_log > 0) and torch.all(whole.A_log <= torch.log(torch.tensor(16.0)))
    assert torch.equal(whole.A_log[:3], again.A_log[:3])  # tile 0: same seed as one draw
    dt = torch.nn.functional.softplus(whole.dt_bias)
    assert torch.all(dt > 0.999e-3) and torch.all(dt < 1.001e-1)


def test_a_tp_rank_never_builds_the_whole_output_head():
    """With a vocabulary of two default tiles (as at K3 size, where the head spans many), neither
    building nor initialising a TP rank allocates the whole `[vocab, hidden]` matrix."""
    config = dataclasses.replace(ModelConfig(), vocab_size=2**18, num_hidden_layers=2, attn_res_block_size=1)
    with LargestAllocation([]) as recorder:
        model = tp_rank_model(config, tp=2, rank=1)
    assert model.lm_head.weight.shape == (config.vocab_size // 2, config.hidden_size)
    assert (config.vocab_size, config.hidden_size) not in recorder.shapes
    with pytest.raises(ValueError, match="vocab_size"):
        tp_rank_model(dataclasses.replace(config, vocab_size=config.vocab_size + 1), tp=2, rank=0)
