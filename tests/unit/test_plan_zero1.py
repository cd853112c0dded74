"""ZeRO-1 traffic at K3 size, from the job's own bucket planning (`build_planning_rank` builds
the reducer and the optimizer of a rank of `recipes/k3.yaml` on the meta device, as
`pretrain_k3.py` builds them): gradients reach their owners by reduce-scatters at about the
volume of a distributed optimizer, where an all-reduce + all-gather sends 1.5× that."""

import pytest

from k3train.config import load_config
from k3train.parallel.grad_reduce import owner_rows
from k3train.parallel.state import layout_of
from k3train.planning.layout_traffic import data_parallel_wire_bytes
from k3train.training.build import build_planning_rank
from tests.distributed.harness import CHECKOUT

K3 = str(CHECKOUT / "recipes" / "k3.yaml")
DATA_GROUPS = ("dp", "data_tensor", "expert_dp")


# The recipe with cp 1, fp32 weights and fp32 gradients (dp 8 at 1,024 GPUs, six-layer stages
# from pp1): the layout these volumes were read on; the recipe's own cp 2 halves dp.
FP32_CP1 = [
    "parallel.cp=1",
    "train.weights=fp32",
    "train.grad_dtype=fp32",
    "parallel.pipeline_layers=[5,6,6,6,6,6,6,6,6,6,6,6,6,6,6,4]",
]


def k3_rank(world_size: int, pp_rank: int):
    config = load_config(K3, FP32_CP1)
    p, m = config.parallel, config.model
    layout = layout_of(world_size, p, m)
    return build_planning_rank(config, layout, layout.rank_of(0, 0, pp_rank))


@pytest.fixture(scope="module")
def k3_pp1():
    return k3_rank(1024, 1)


def test_owner_rows_reduce_scatter_without_padding(k3_pp1):
    job = k3_pp1
    dp = job.parallel.dp.size
    rows = owner_rows(reversed(list(job.model.named_parameters())), job.optimizer.plan.owners, job.parallel)
    assert len(rows) >= 10
    for row in rows:
        assert [job.optimizer.plan.owners[name] for name, _ in row] == list(range(dp))
        assert len({param.numel() for _, param in row}) == 1
    in_rows = {id(param) for row in rows for _, param in row}
    for bucket in job.reducer.buckets:
        if any(id(param) in in_rows for param in bucket.params):
            assert bucket.sharded and all(id(param) in in_rows for param in bucket.params)
            assert bucket.length == bucket.numel + len(bucket.params)  # no padding


def test_k3_gradients_and_exchange_at_distributed_optimizer_volume(k3_pp1):
    """The recipe at 1,024 GPUs with cp 1 and fp32 gradients (dp 8, tp 8, ep 64), pipeline rank 1: ring bytes on the
    network groups within 10% of a padding-free reduce-scatter + all-gather (2(p−1)/p of the
    fp32 gradients), and at least 1.3× below all-reducing the same buckets plus the same
    exchange (the old ZeRO-1's 1.5× less the padding); more than 90% of the gradient elements
    reach their owners by reduce-scatter (TP-partial ones then all-reduce only the owner's
    segment over tp, on NVLink)."""
    job = k3_pp1
    p = job.parallel.dp.size
    buckets = [b for b in job.reducer.buckets if (b.scatter_group or b.reduction.group).size > 1]
    elements = sum(b.numel for b in buckets)
    scattered = sum(b.numel for b in buckets if b.sharded)
    assert scattered / elements > 0.9
    ideal = 2 * (p - 1) / p * elements * 4
    now = sum(v for g, v in data_parallel_wire_bytes(job).items() if g in DATA_GROUPS)
    before = sum(v for g, v in data_parallel_wire_bytes(job, all_reduced=True).items() if g in DATA_GROUPS)
    print(f"K3 pp1 wire: {now / 2**30:.2f} GiB, ideal {ideal / 2**30:.2f}, all-reduced {before / 2**30:.2f}")
    assert ideal <= now <= 1.10 * ideal
    assert before / now > 1.3
    assert "tp" in data_parallel_wire_bytes(job)  # the TP-partial second phase


def test_oversized_parameters_are_broadcast_not_padded():
    """Pipeline rank 0 holds the embedding (vocab/tp × d = 147M elements, one owner): the
    all-gather would pad all 8 buffers to it, so its owner broadcasts it instead and the padded
    buffer stays within 10% of an even share."""
    job = k3_rank(1024, 0)
    (exchange,) = [e for e in job.optimizer._exchanges if e.group.name == "dp"]
    names = {id(param): name for name, param in job.model.named_parameters()}
    assert "embed_tokens.weight" in {names[id(param)] for param, _ in exchange.broadcast}
    gathered = sum(param.numel() for owned in exchange.per_rank for param, _ in owned)
    assert exchange.length <= 1.10 * gathered / exchange.group.size
