"""MLA's attention under context parallelism: every cp rank's pieces, run in one process, equal
the whole sequence's causal attention (float64), with and without packed documents, and the
scores each rank computes are the causal minimum.

Tolerance 1e-12 (float64): the pieces compute the same softmax sums as the whole-sequence call
over the same keys, only the key ranges are cut differently, so the differences are a few ulps
(unit roundoff 1.1e-16 × a few hundred terms; measured below 1e-15)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias
from torch.overrides import TorchFunctionMode

from k3train.model.mla import causal_attention_reference
from k3train.parallel.comm import Group, TrafficCounter
from k3train.parallel.context import ContextParallel, context_attention

TOLERANCE = 1e-12
HEADS, QK_DIM, V_DIM = 2, 12, 8  # v narrower than q/k, as in MLA


def cp_rank(size: int, rank: int) -> ContextParallel:
    """A cp rank's layout without processes (context_attention needs no collective)."""
    return ContextParallel(Group("cp", tuple(range(size)), rank, None, TrafficCounter()))


def inputs(seq: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, seq, HEADS, QK_DIM), (2, seq, HEADS, QK_DIM), (2, seq, HEADS, V_DIM)]
    return [torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True) for shape in shapes]


def document_reference(q, k, v, scale, document_starts):
    """Dense masked attention over the whole sequence: causal and same document."""
    seq = q.shape[1]
    documents = document_starts.to(torch.int64).cumsum(1)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = (causal & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale
    ).transpose(1, 2)


def starts_for(seq: int) -> torch.Tensor:
    """Two rows with documents starting inside pieces, at piece starts and one token before one."""
    starts = torch.zeros(2, seq, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, [5, seq // 2, seq // 2 + 3]] = True
    starts[1, [seq // 4 - 1, seq - 7]] = True
    return starts


@pytest.mark.parametrize("size,seq", [(2, 24), (4, 32), (4, 40)])
@pytest.mark.parametrize("with_documents", [False, True])
def test_pieces_equal_the_whole_sequence(size, seq, with_documents):
    scale = 0.3
    q, k, v = inputs(seq, seed=size + seq)
    starts = starts_for(seq) if with_documents else None
    if starts is None:
        reference = causal_attention_reference(q, k, v, scale)
    else:
        reference = document_reference(q, k, v, scale, starts)
    upstream = torch.randn_like(reference)
    expected_grads = torch.autograd.grad((reference * upstream).sum(), (q, k, v))
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(size):
        cp = cp_rank(size, rank)
        local_q = cp.shard_sequence(q.detach()).requires_grad_()
        keys, values = k.detach().requires_grad_(), v.detach().requires_grad_()
        out = context_attention(local_q, keys, values, cp, scale, starts)
        torch.testing.assert_close(out, cp.shard_sequence(reference), rtol=0, atol=TOLERANCE)
        g_q, g_k, g_v = torch.autograd.grad((out * cp.shard_sequence(upstream)).sum(), (local_q, keys, values))
        # this rank's query gradient goes to its own positions; key/value gradients add up over ranks
        positions = cp.positions(local_q.shape[1])
        grads[0][:, positions] += g_q
        grads[1] += g_k
        grads[2] += g_v
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)


class ScoreCounter(TorchFunctionMode):
    """Counts the query-key scores each SDPA call computes: a lower-right causal call the pairs
    on or below its diagonal (what a causal flash kernel computes, up to its tiles), an upper-left
    causal call its triangle, any other call (a dense or tensor-masked one) every pair."""

    def __init__(self):
        super().__init__()
        self.scores = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            batch_heads = q.shape[0] * q.shape[1]
            queries, keys = q.shape[-2], k.shape[-2]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if isinstance(mask, CausalBias) or kwargs.get("is_causal", False):
                # query i sees keys up to keys − queries + i (lower right; square: the triangle)
                self.scores += batch_heads * (queries * (keys - queries) + queries * (queries + 1) // 2)
            else:
                self.scores += batch_heads * queries * keys
            with torch._C.DisableTorchFunction():  # don't count the bias's own inner calls
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_computes_the_causal_minimum_of_scores(size):
    """The causal minimum of a rank: each local query scores the keys at or before its true
    position, Σ (position + 1). Bound 1.05× of it (the issue's target); the lower-right pieces
    compute exactly it (measured ratio 1.000 on every rank), the old dense `[2L, T]` call 1.97× at
    this length (→ 2× as T grows)."""
    seq = 64
    q, k, v = inputs(seq, seed=size)
    ratios = []
    for rank in range(size):
        cp = cp_rank(size, rank)
        local_q = cp.shard_sequence(q.detach())
        with ScoreCounter() as counter:
            context_attention(local_q, k.detach(), v.detach(), cp, 0.3)
        minimum = 2 * HEADS * int((cp.positions(local_q.shape[1]) + 1).sum())
        ratios.append(counter.scores / minimum)
        dense = 2 * HEADS * local_q.shape[1] * seq
        assert dense / minimum > 1.5  # what the one dense masked call computed
    assert max(ratios) <= 1.05, ratios
    assert min(ratios) >= 1.0, ratios  # the counter sees every call
