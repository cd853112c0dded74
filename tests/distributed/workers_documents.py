"""Worker side of tests/distributed/test_packed_documents.py: packed documents under TP, PP and CP
against the same documents run one by one in one process.

For each layout every rank builds its job as `pretrain_k3.py` does (`build_rank`, with
`data.document_boundaries=reset` and `data.eod_mask_loss`), in float64, and runs one step over
its data rank's rows as `TokenBatch`es (tokens, document starts, loss mask). The reference is a
single-process model that runs every document of the global batch alone, with the loss
`Σ masked token losses / all tokens` (the job's masked mean): the step loss and every gradient
must agree. Only numbers travel back to the test.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from k3train.contracts.token_batch import TokenBatch
from k3train.data.documents import token_batch
from k3train.model.k3 import K3ModelChunk
from k3train.model.moe import finish_expert_step
from k3train.parallel.config import ModelSplitSizes
from k3train.parallel.grad_reduce import average_over_dp
from k3train.parallel.state import ParallelState, resolve_layout
from k3train.training.build import build_rank
from tests.distributed.workers_context import CONFIG, SEED, job_config, reference_view

EOS = 0
SEQ = 32
# Document lengths per row. Under cp2 the pieces are [0, 8), [8, 16), [16, 24), [24, 32): row 0
# has a start inside piece 0, a document spanning pieces 0-1, piece 2 beginning with a start and
# a one-token document; row 1 a document over three pieces; row 2 a document starting one token
# before piece 3 (its convolution tail keeps only that token); row 3 one document.
ROWS = [[5, 11, 1, 15], [20, 12], [23, 9], [32]]


def packed_rows() -> TokenBatch:
    """Random tokens with an eos ending every document, their starts and the eod loss mask."""
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(1, CONFIG.vocab_size, (len(ROWS), SEQ + 1), generator=generator)
    starts = torch.zeros(len(ROWS), SEQ, dtype=torch.bool)
    for row, lengths in enumerate(ROWS):
        position = 0
        for length in lengths:
            starts[row, position] = True
            position += length
            tokens[row, position - 1] = EOS
    return token_batch(tokens, starts, EOS, reset=True, eod_mask_loss=True)


def documents_alone_reference(batch: TokenBatch, seed: int) -> tuple[K3ModelChunk, float]:
    """The model's gradients and loss with every document of `batch` run on its own."""
    assert batch.loss_mask is not None
    reference = K3ModelChunk(CONFIG, seed=seed).double()
    total = torch.zeros((), dtype=torch.float64)
    for row, lengths in enumerate(ROWS):
        position = 0
        for length in lengths:
            part = slice(position, position + length)
            logits = reference(batch.inputs[row : row + 1, part])
            losses = F.cross_entropy(logits[0], batch.labels[row, part], reduction="none")
            total = total + (losses * batch.loss_mask[row, part]).sum()
            position += length
    loss = total / batch.labels.numel()
    loss.backward()
    return reference, loss.item()


def compare(env, spec: dict[str, Any]) -> dict[str, Any]:
    spec = {"seq": SEQ, "global_batch": len(ROWS), "cp": 1, **spec}
    config = job_config(spec)
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, document_boundaries="reset", eod_mask_loss=True)
    )
    p = config.parallel
    layout = resolve_layout(env.world_size, p.tp, p.pp, 0, p.ep, 1, ModelSplitSizes.of(CONFIG), cp=p.cp)
    state = ParallelState(layout, env.rank, sequence_parallel=p.sequence_parallel)
    job = build_rank(config, state, torch.device("cpu"), overlap=False, dtype=torch.float64)
    job.schedule.dtype = torch.float64  # pipeline hops in the model's dtype
    for chunk in job.model.chunks:
        chunk.cp.state_exchange = spec.get("state_exchange", "handoff")

    batch = packed_rows()
    reference, reference_loss = documents_alone_reference(batch, config.train.seed)

    rows = spec["global_batch"] // layout.data_parallel
    mine = TokenBatch(*(t[state.data_rank * rows : (state.data_rank + 1) * rows] for t in dataclasses.astuple(batch)))
    local_loss = job.schedule.run(job.model.chunks, mine.split(spec["micro_batch"]))
    job.reducer.finish()
    finish_expert_step(job.model.moe_layers(), state)
    loss = average_over_dp(local_loss, state).item()

    reference_params = dict(reference.named_parameters())
    worst, worst_name, checked = 0.0, "", 0
    for name, param in job.model.named_parameters():
        reference_grad = reference_params[name].grad
        if reference_grad is None:
            continue
        assert param.grad is not None, f"{name}: no gradient"
        error = (param.grad - reference_view(reference_grad, param, state)).abs().max().item()
        checked += 1
        if error > worst:
            worst, worst_name = error, name
    return {
        "name": spec["name"],
        "loss": loss,
        "reference_loss": reference_loss,
        "max_grad_error": worst,
        "worst_param": worst_name,
        "checked": checked,
    }


def run_checks(env, payload: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [compare(env, spec) for spec in payload]
