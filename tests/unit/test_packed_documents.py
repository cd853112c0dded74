"""Packed documents: the segment kernels against their references, and the model over a packed
sequence against the same documents run one by one (logits and gradients, float64)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from k3train.contracts.token_batch import TokenBatch
from k3train.data import DataConfig, IndexedDataset, PackedDataset, build_data, write_indexed_dataset
from k3train.data.documents import document_lengths, token_batch
from k3train.kernels.kda.varlen import chunk_kda_varlen, chunk_kda_varlen_reference
from k3train.kernels.segments import pack_segments, segment_ids, segment_offsets, unpack_segments
from k3train.kernels.short_conv import short_conv_silu_varlen, short_conv_silu_varlen_reference
from k3train.model.config import ModelConfig
from k3train.model.k3 import K3ModelChunk
from k3train.model.mla import causal_attention, document_causal_attention

F64 = torch.float64
TOLERANCE = 1e-12


def starts_of(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """`[rows, T]` bool: True at the first token of every document."""
    seq = sum(lengths_per_row[0])
    starts = torch.zeros(len(lengths_per_row), seq, dtype=torch.bool)
    for row, lengths in enumerate(lengths_per_row):
        assert sum(lengths) == seq
        position = 0
        for length in lengths:
            starts[row, position] = True
            position += length
    return starts


ROWS = [[5, 11, 1, 15], [20, 12]]


def test_segment_offsets_pack_and_unpack():
    starts = starts_of(ROWS)
    starts[1, 0] = False  # a row always starts a segment
    cu_seqlens = segment_offsets(starts)
    assert cu_seqlens.tolist() == [0, 5, 16, 17, 32, 52, 64]
    x = torch.arange(64.0).reshape(64, 1)
    packed = pack_segments(x, cu_seqlens)
    assert packed.shape == (6, 20, 1)
    assert packed[1, :11, 0].tolist() == list(range(5, 16)) and not packed[1, 11:].any()
    assert torch.equal(unpack_segments(packed, cu_seqlens), x)
    assert segment_ids(starts)[0].tolist() == [0] * 5 + [1] * 11 + [2] + [3] * 15
    # rows without a boundary: the packed batch is the rows themselves
    whole = segment_offsets(torch.zeros(2, 32, dtype=torch.bool))
    assert torch.equal(pack_segments(x, whole), x.view(2, 32, 1))
    assert torch.equal(unpack_segments(pack_segments(x, whole), whole), x)


@pytest.mark.parametrize("chunk_size", [4, 8])
def test_varlen_kda_matches_reference_with_states_float64(chunk_size):
    torch.manual_seed(0)
    cu_seqlens = segment_offsets(starts_of(ROWS))
    segments, tokens, heads, key_dim, value_dim = len(cu_seqlens) - 1, 64, 2, 8, 4
    q = F.normalize(torch.randn(1, tokens, heads, key_dim, dtype=F64), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(1, tokens, heads, key_dim, dtype=F64), dim=-1).requires_grad_()
    v = torch.randn(1, tokens, heads, value_dim, dtype=F64, requires_grad=True)
    g = (-torch.rand(1, tokens, heads, key_dim, dtype=F64)).requires_grad_()
    beta = torch.rand(1, tokens, heads, dtype=F64, requires_grad=True)
    initial = torch.randn(segments, heads, key_dim, value_dim, dtype=F64, requires_grad=True)
    inputs = (q, k, v, g, beta, initial)
    results = []
    for kernel in (chunk_kda_varlen_reference, chunk_kda_varlen):
        extra = {"chunk_size": chunk_size} if kernel is chunk_kda_varlen else {}
        o, final = kernel(q, k, v, g, beta, cu_seqlens, initial_state=initial, output_final_state=True, **extra)
        (o.square().sum() + final.sum()).backward()
        results.append([o.detach(), final.detach()] + [t.grad.clone() for t in inputs])
        for t in inputs:
            t.grad = None
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


def test_varlen_short_conv_matches_reference_with_tails_float64():
    torch.manual_seed(1)
    cu_seqlens = segment_offsets(starts_of(ROWS))
    x = torch.randn(1, 64, 6, dtype=F64, requires_grad=True)
    weight = torch.randn(6, 1, 4, dtype=F64, requires_grad=True)
    tails = torch.randn(len(cu_seqlens) - 1, 6, 3, dtype=F64, requires_grad=True)
    grads = []
    for kernel in (short_conv_silu_varlen_reference, short_conv_silu_varlen):
        out = kernel(x, weight, cu_seqlens, tails)
        out.square().sum().backward()
        grads.append([out.detach()] + [t.grad.clone() for t in (x, weight, tails)])
        x.grad = weight.grad = tails.grad = None
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)


def test_document_attention_is_each_document_alone():
    torch.manual_seed(2)
    starts = starts_of(ROWS)
    q, k_nope = torch.randn(2, 32, 3, 8, dtype=F64), torch.randn(2, 32, 3, 5, dtype=F64)
    k_rope, v = torch.randn(2, 32, 3, 3, dtype=F64), torch.randn(2, 32, 3, 4, dtype=F64)
    out = document_causal_attention(q, k_nope, k_rope, v, 0.3, starts)
    for row, lengths in enumerate(ROWS):
        position = 0
        for length in lengths:
            part = slice(position, position + length)
            alone = causal_attention(*(t[row : row + 1, part] for t in (q, k_nope, k_rope, v)), 0.3)
            torch.testing.assert_close(out[row : row + 1, part], alone, rtol=TOLERANCE, atol=TOLERANCE)
            position += length


def document_config(**changes) -> ModelConfig:
    """The default small model, with KDA chunks of 8 so documents cross chunk boundaries."""
    config = ModelConfig()
    return dataclasses.replace(
        config, linear_attn_config=dataclasses.replace(config.linear_attn_config, chunk_size=8), **changes
    )


def packed_against_alone(model: K3ModelChunk, tokens: torch.Tensor, rows: list[list[int]]):
    """Largest logit and gradient differences between the packed rows and their documents alone
    (loss: the sum of every token's cross-entropy, so both sides weigh each token once)."""
    starts = starts_of(rows)
    logits = model(tokens[:, :-1], document_starts=starts)
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum").backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logit_error = 0.0
    for row, lengths in enumerate(rows):
        position = 0
        for length in lengths:
            inputs = tokens[row : row + 1, position : position + length]
            labels = tokens[row : row + 1, position + 1 : position + length + 1]
            alone = model(inputs)
            logit_error = max(
                logit_error, (alone - logits[row : row + 1, position : position + length]).abs().max().item()
            )
            F.cross_entropy(alone.flatten(0, 1), labels.flatten(), reduction="sum").backward()
            position += length
    grad_error = max(
        (p.grad - packed_grads[name]).abs().max().item() for name, p in model.named_parameters() if p.grad is not None
    )
    assert set(packed_grads) == {name for name, p in model.named_parameters() if p.grad is not None}
    return logit_error, grad_error


@pytest.mark.parametrize("changes", [{}, {"attn_res": "none", "recompute": "sublayer"}])
def test_packed_sequence_equals_documents_one_by_one_float64(changes):
    torch.manual_seed(3)
    model = K3ModelChunk(document_config(**changes), seed=5).double()
    tokens = torch.randint(0, model.config.vocab_size, (2, 33))
    logit_error, grad_error = packed_against_alone(model, tokens, ROWS)
    assert logit_error < TOLERANCE and grad_error < TOLERANCE, (logit_error, grad_error)


def test_without_resets_documents_see_each_other():
    """The check can fail: the stream of one row is not its documents alone."""
    torch.manual_seed(3)
    model = K3ModelChunk(document_config(), seed=5).double()
    tokens = torch.randint(0, model.config.vocab_size, (1, 17))
    logits = model(tokens[:, :-1])
    alone = model(tokens[:, 6:16])
    assert (logits[:, 6:16] - alone).abs().max() > 1e-3


def test_eod_loss_mask_drops_masked_tokens():
    torch.manual_seed(4)
    model = K3ModelChunk(document_config(), seed=5).double()
    tokens = torch.randint(0, model.config.vocab_size, (2, 9))
    logits = model(tokens[:, :-1])
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 3] = mask[1, 6] = False
    per_token = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    expected = per_token[mask.flatten()].sum() / per_token.numel()
    torch.testing.assert_close(model.loss(logits, tokens[:, 1:], mask), expected, rtol=1e-14, atol=1e-14)
    assert not torch.allclose(model.loss(logits, tokens[:, 1:]), expected)


def test_document_starts_come_from_the_document_index(tmp_path):
    # eos = 0; the second document holds an eos of its own, which starts nothing.
    write_indexed_dataset(tmp_path / "ds", [[1, 2], [3, 0, 4], [5]], vocab_size=10)
    packed = PackedDataset(
        IndexedDataset(tmp_path / "ds"), np.arange(3), 4, 0, seed=0, salt=0, shuffle=False, name="ds"
    )
    tokens, starts = packed.samples_with_starts(np.arange(2))
    assert tokens.tolist() == [[1, 2, 0, 3, 0], [0, 4, 0, 5, 0]]
    assert starts.tolist() == [[True, False, False, True], [False, False, False, True]]
    batch = token_batch(torch.from_numpy(tokens), torch.from_numpy(starts), 0, reset=True, eod_mask_loss=True)
    assert batch.document_starts is not None and batch.loss_mask is not None
    assert batch.document_starts.tolist() == [[True, False, False, True], [True, False, False, True]]
    assert batch.loss_mask.tolist() == [[True, True, False, True], [False, True, False, True]]
    assert document_lengths(batch.document_starts) == [[3, 1], [3, 1]]
    plain = token_batch(torch.from_numpy(tokens), torch.from_numpy(starts), 0, reset=False, eod_mask_loss=False)
    assert plain.document_starts is None and plain.loss_mask is None


def test_training_data_yields_starts_only_with_reset(tmp_path):
    documents = [np.full(n, 7 + i) for i, n in enumerate([5, 9, 3, 12, 6, 8, 4, 10])]
    write_indexed_dataset(tmp_path / "ds", documents, vocab_size=259)
    common = dict(paths=[str(tmp_path / "ds")], seq_length=8, validation_fraction=0.0)
    reset = build_data(DataConfig(document_boundaries="reset", **common), 4, 1, 259).next_batch(4)
    none = build_data(DataConfig(**common), 4, 1, 259).next_batch(4)
    assert torch.equal(reset.tokens, none.tokens) and none.document_starts is None
    assert reset.document_starts is not None and reset.document_starts[:, 0].all()
    # every start after position 0 follows an eos (the packing puts one after each document)
    rows, columns = torch.nonzero(reset.document_starts[:, 1:], as_tuple=True)
    assert len(rows) > 0 and (reset.tokens[rows, columns] == 256).all()
    parts = reset.split(2)
    assert [p.tokens.shape[0] for p in parts] == [2, 2] and isinstance(parts[1], TokenBatch)
    assert parts[1].document_starts is not None and torch.equal(parts[1].document_starts, reset.document_starts[2:])


def test_flop_count_of_packed_documents():
    from k3train.model import flops
    from k3train.planning.time import layer_training_flops

    config = ModelConfig()
    one_stream = flops.training_flops_per_token(config, 128)
    assert flops.training_flops_per_token(config, 128, document_lengths=[128]) == one_stream
    documents = flops.documents_of_length(128, 48)
    assert documents == [48, 48, 32]
    apart = flops.training_flops_per_token(config, 128, document_lengths=documents)
    pairs = sum(d * (d + 1) / 2 for d in documents)
    per_pair = 2 * config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    expected = flops.TRAINING_MULTIPLIER * flops.num_mla_layers(config) * per_pair * pairs / 128
    assert apart.mla_attention == pytest.approx(expected, rel=1e-12)
    assert apart.mla_attention < one_stream.mla_attention
    assert apart.mla_projections == one_stream.mla_projections  # every token still projects
    # KDA pads every document to whole chunks of 64: 1 + 1 + 1 chunks against 2 for the stream.
    assert apart.kda_chunk == pytest.approx(one_stream.kda_chunk * 3 / 2, rel=1e-12)
    mla_layer = min(config.full_attn_layer_set)
    assert layer_training_flops(config, mla_layer, 128, documents) < layer_training_flops(config, mla_layer, 128)
    with pytest.raises(ValueError, match="fill a sequence"):
        flops.training_flops_per_token(config, 128, document_lengths=[100])
