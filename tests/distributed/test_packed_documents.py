"""Packed documents through the parallel layouts: TP2 (with and without sequence parallelism),
PP2 (the document starts travel with each micro-batch's activations), CP2 (starts inside
pieces, documents spanning pieces, both KDA state exchanges) reproduce, in float64, the loss and
every gradient of the documents run one by one in one process (tests/distributed/
workers_documents.py). One launch of two gloo ranks, one of four for CP combined with PP and
TP + SP.

Tolerance: 1e-12 absolute on the loss (≈ 5.5) and on every gradient: the layouts compute the
same sums in other association orders (sharded heads, states through the pieces' affine maps,
gathered keys), a few ulps apart.
"""

from tests.distributed.harness import run_workers

TOLERANCE = 1e-12

TWO_RANKS = [
    dict(name="tp2", tp=2, micro_batch=2),
    dict(name="tp2 + sp", tp=2, sp=True, micro_batch=2),
    dict(name="pp2, 2 micro-batches", pp=2, micro_batch=2),
    dict(name="cp2", cp=2, micro_batch=2),
    dict(name="cp2, states gathered", cp=2, micro_batch=4, state_exchange="gather"),
    dict(name="dp2", micro_batch=1),
]
FOUR_RANKS = [
    dict(name="cp2 x pp2, 2 micro-batches", cp=2, pp=2, micro_batch=2),
    dict(name="cp2 x tp2 + sp", cp=2, tp=2, sp=True, micro_batch=2),
]


def check(results: list[list[dict]]) -> None:
    for rank, per_layout in enumerate(results):
        for result in per_layout:
            label = (result["name"], rank)
            assert abs(result["loss"] - result["reference_loss"]) < TOLERANCE, (label, result)
            assert result["max_grad_error"] < TOLERANCE, (label, result["worst_param"], result["max_grad_error"])
            assert result["checked"] > 40, label
    print({result["name"]: result["max_grad_error"] for result in results[0]})


def test_packed_documents_through_tp_pp_cp():
    check(run_workers(2, "tests.distributed.workers_documents:run_checks", TWO_RANKS, timeout_s=420))


def test_packed_documents_through_cp_with_pp_and_tp():
    check(run_workers(4, "tests.distributed.workers_documents:run_checks", FOUR_RANKS, timeout_s=480))
