"""The `exact` transport's device-split all-to-all (`parallel/device_splits.py` `SymmetricCounts`,
NVSHMEM's `all_to_all_vdev`) on a group of one GPU: the rows the counts name arrive, the rest of
the fixed buffer is zero, nothing is read on the host, and a second exchange reuses the buffers.
One rank sends only to itself, so this checks the glue (symmetric buffers, the side stream, the
splits, the zeroed tail), not the network; the layouts are the gloo tests'
(`tests/distributed/test_expert_parallel.py`, `exact`)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .common import BF16, Context, Row, guarded, skip


def check_device_splits(ctx: Context) -> Iterator[Row]:
    name = "device_splits nvshmem"
    if not ctx.cuda:
        yield skip(name, "needs CUDA (NVSHMEM); on CPU the counts are read on the host (HostCounts)")
        return
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        yield skip(name, "NVSHMEM is not installed (the `exact` transport reads its counts on the host)")
        return
    yield guarded(ctx, name, lambda: device_split_row(ctx, name))


def device_split_row(ctx: Context, name: str) -> Row:
    from k3train.parallel.comm import Group, TrafficCounter
    from k3train.parallel.device_splits import SymmetricCounts

    owned = not dist.is_initialized()
    if owned:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=ctx.device)
    try:
        process_group = dist.new_group([0])
        group = Group("ep", (0,), 0, process_group, TrafficCounter())
        exchange = SymmetricCounts(group)
        rows, width, capacity = ctx.pick((4096, 3584, 5120), (64, 32, 80))
        gen = ctx.generator(3)
        worst = 0.0
        for kept in (rows, rows // 3):  # every row, then a prefix: the tail must come back zero
            x = ctx.randn(rows, width, gen=gen, dtype=BF16)
            counts = torch.tensor([kept], dtype=torch.int64, device=ctx.device)
            output = x.new_zeros(capacity, width)
            exchange.launch(x, output, counts, counts, "ep").wait()
            expected = torch.cat([x[:kept], x.new_zeros(capacity - kept, width)])
            worst = max(worst, (output.float() - expected.float()).abs().max().item())
        torch.cuda.synchronize()
        reused = sum(len(pool) for pool in exchange._pool.values()) == 1
        status = "PASS" if worst == 0.0 and reused else "FAIL"
        return Row(
            name, status, max_abs=worst, tol=0.0, note=f"{rows} rows of {width} into {capacity}; reused={reused}"
        )
    finally:
        if owned:
            dist.destroy_process_group()
