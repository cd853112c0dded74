"""Kimi Delta Attention kernels (docs/design.md §1.1): the recurrent reference checked by hand, the
chunkwise form held to the reference in float64, fp32 range at the worst-case decay, bf16, the
gates, and the guarded fla dispatch."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from k3train.kernels.kda import (
    chunk_kda,
    chunk_training,
    fla_backend,
    kda_gate,
    kda_gate_unbounded,
    naive_recurrent_kda,
)
from k3train.kernels.kda.chunk import chunk_kda_autograd_reference
from k3train.kernels.kda.tiles import (
    causal_keys_seen,
    causal_keys_seen_of_tile,
    decayed_gram_matrices,
    diagonal_tile_size,
    keys_seen_from_row_tiles,
    tile_decay,
)

F64 = torch.float64


def make_inputs(
    seq_len: int,
    *,
    batch: int = 2,
    heads: int = 2,
    key_dim: int = 16,
    value_dim: int = 8,
    gate: str = "bounded",
    dtype: torch.dtype = F64,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Kernel inputs (normalised q/k, beta in (0,1)) and a random initial state.

    gate: "bounded" (K3's range, g in (−5, 0)), "worst" (g = −5 everywhere), "unbounded"
    (Kimi Linear's gate with large rates, g down to about −100) or "none" (g = 0).
    K ≠ V on purpose, so a transposed state would not fit.
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=F64)

    shape = (batch, seq_len, heads, key_dim)
    if gate == "bounded":
        g = -5.0 * torch.sigmoid(2.0 * randn(*shape))
    elif gate == "worst":
        g = torch.full(shape, -5.0, dtype=F64)
    elif gate == "unbounded":
        g = -20.0 * F.softplus(2.0 * randn(*shape))
    elif gate == "none":
        g = torch.zeros(shape, dtype=F64)
    else:
        raise ValueError(gate)
    inputs = {
        "q": F.normalize(randn(*shape), dim=-1),
        "k": F.normalize(randn(*shape), dim=-1),
        "v": randn(batch, seq_len, heads, value_dim),
        "g": g,
        "beta": torch.sigmoid(randn(batch, seq_len, heads)),
    }
    initial_state = 0.5 * randn(batch, heads, key_dim, value_dim)
    return {name: x.to(dtype) for name, x in inputs.items()}, initial_state.to(dtype)


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------ the reference by hand
def hand_case() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """B = H = 1, K = 2, V = 1, T = 2, small exact numbers (worked through in the test)."""
    inputs = {
        "q": torch.tensor([[1.0, 1.0], [0.0, 1.0]], dtype=F64),
        "k": torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=F64),
        "v": torch.tensor([[6.0], [1.0]], dtype=F64),
        "g": torch.tensor([[math.log(0.5), 0.0], [0.0, math.log(0.25)]], dtype=F64),
        "beta": torch.tensor([0.5, 0.5], dtype=F64),
    }
    inputs = {name: x.reshape(1, 2, 1, -1) for name, x in inputs.items()}
    inputs["beta"] = inputs["beta"].reshape(1, 2, 1)
    initial_state = torch.tensor([[4.0], [2.0]], dtype=F64).reshape(1, 1, 2, 1)
    return inputs, initial_state


def test_backward_under_activation_checkpointing():
    """Inside `torch.utils.checkpoint` (non-reentrant, what `model.recompute` uses) the backward
    unpacks each saved tensor once and gives the gradients of a plain run."""
    from torch.utils.checkpoint import checkpoint

    inputs, initial_state = make_inputs(40, gate="worst")
    names = [*inputs, "initial_state"]
    plain = {name: x.clone().requires_grad_() for name, x in {**inputs, "initial_state": initial_state}.items()}
    recomputed = {name: x.detach().clone().requires_grad_() for name, x in plain.items()}

    def run(*tensors):
        o, state = chunk_kda(*tensors[:5], initial_state=tensors[5], output_final_state=True, chunk_size=16)
        return o.sum() + state.square().sum()

    run(*(plain[name] for name in names)).backward()
    checkpoint(run, *(recomputed[name] for name in names), use_reentrant=False).backward()
    for name in names:
        assert max_error(recomputed[name].grad, plain[name].grad) < 1e-12, name


@pytest.mark.parametrize("kernel", [naive_recurrent_kda, chunk_kda])
def test_recurrence_matches_hand_arithmetic(kernel):
    # S0 = [4, 2]ᵀ (K = 2 rows, V = 1 column), scale = 1.
    # t=1: decay by [0.5, 1]         -> S = [2, 2];   kᵀS = 2,   v − kᵀS = 4
    #      S += 0.5·[1, 0]·4          -> S = [4, 2];   o = [1, 1]·S = 6
    # t=2: decay by [1, 0.25]        -> S = [4, 0.5]; kᵀS = 0.6·4 + 0.8·0.5 = 2.8, v − kᵀS = −1.8
    #      S += 0.5·[0.6, 0.8]·(−1.8) -> S = [3.46, −0.22]; o = [0, 1]·S = −0.22
    inputs, initial_state = hand_case()
    o, final_state = kernel(**inputs, scale=1.0, initial_state=initial_state, output_final_state=True)
    expected_o = torch.tensor([6.0, -0.22], dtype=F64)
    torch.testing.assert_close(o.flatten(), expected_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(final_state.flatten(), torch.tensor([3.46, -0.22], dtype=F64), rtol=0, atol=1e-12)
    # The default scale is K^-1/2, and o is linear in the scale.
    o_default, _ = kernel(**inputs, initial_state=initial_state)
    torch.testing.assert_close(o_default, o * 2**-0.5, rtol=0, atol=1e-12)
    # Without an initial state nothing is carried in: t=1 alone writes 0.5·[1,0]·6 -> o = 3.
    o_fresh, _ = kernel(**{name: x[:, :1] for name, x in inputs.items()}, scale=1.0)
    torch.testing.assert_close(o_fresh.flatten(), torch.tensor([3.0], dtype=F64), rtol=0, atol=1e-12)


# ------------------------------------------------------------------ chunked vs recurrent, float64
@pytest.mark.parametrize("chunk_size", [32, 64])
@pytest.mark.parametrize("gate", ["bounded", "worst", "unbounded"])
def test_chunk_matches_recurrent_float64(chunk_size, gate):
    # T = 100 is not a multiple of either chunk size: the padded tail must not touch the state.
    inputs, initial_state = make_inputs(100, gate=gate)
    o_ref, state_ref = naive_recurrent_kda(**inputs, initial_state=initial_state, output_final_state=True)
    o, state = chunk_kda(**inputs, initial_state=initial_state, output_final_state=True, chunk_size=chunk_size)
    assert o.dtype == F64 and state.dtype == F64
    assert max_error(o, o_ref) < 1e-9
    assert max_error(state, state_ref) < 1e-9


@pytest.mark.parametrize(
    "chunk_size, gate",
    [(32, "bounded"), (64, "unbounded")],  # one tile per chunk; tiles of 4 joined by bridges
)
def test_chunk_gradients_match_recurrent_float64(chunk_size, gate):
    inputs, initial_state = make_inputs(100, heads=1, gate=gate)
    leaves = {**inputs, "initial_state": initial_state}
    generator = torch.Generator().manual_seed(1)
    o_weight = torch.randn(inputs["v"].shape, generator=generator, dtype=F64)
    state_weight = torch.randn(initial_state.shape, generator=generator, dtype=F64)

    def gradients(kernel, **kwargs) -> dict[str, torch.Tensor]:
        params = {name: x.clone().requires_grad_() for name, x in leaves.items()}
        o, state = kernel(**params, output_final_state=True, **kwargs)
        loss = (o * o_weight).sum() + (state * state_weight).sum()
        return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))

    reference = gradients(naive_recurrent_kda)
    chunked = gradients(chunk_kda, chunk_size=chunk_size)
    for name in leaves:
        assert max_error(chunked[name], reference[name]) < 1e-9, name


@pytest.mark.parametrize(
    "chunk_size, gate, seq_len, with_initial_state",
    [
        (64, "worst", 150, True),  # tiles of 16 joined by bridges; padded last chunk
        (32, "bounded", 100, True),  # float64: one tile per chunk
        (16, "unbounded", 45, False),  # no initial state: its gradient is None
        (64, "none", 64, True),  # exactly one chunk: no state pass in between
    ],
)
# Chunk-heads per group (backward, forward): chunk by chunk; forward groups of 2 chunks with a
# partial last one (6 heads here), each sliced chunk by chunk in the backward; all in one group.
@pytest.mark.parametrize("group_matrices", [(1, 1), (6, 12), (32, 128)])
def test_hand_written_backward_matches_autograd_reference_float64(
    chunk_size, gate, seq_len, with_initial_state, group_matrices, monkeypatch
):
    """`chunk_kda`'s hand-written backward against autograd through the same chunkwise ops,
    for every input, the initial state, and a loss on both the output and the final state."""
    monkeypatch.setattr(chunk_training, "_GROUP_MATRICES", group_matrices[0])
    monkeypatch.setattr(chunk_training, "_FORWARD_GROUP_MATRICES", group_matrices[1])
    inputs, initial_state = make_inputs(seq_len, heads=3, key_dim=16, value_dim=8, gate=gate)
    leaves = {**inputs, "initial_state": initial_state if with_initial_state else None}
    generator = torch.Generator().manual_seed(2)
    o_weight = torch.randn(inputs["v"].shape, generator=generator, dtype=F64)
    state_weight = torch.randn(initial_state.shape, generator=generator, dtype=F64)
    scale = 0.3

    def run(kernel):
        params = {name: None if x is None else x.clone().requires_grad_() for name, x in leaves.items()}
        o, state = kernel(params)
        loss = (o * o_weight).sum() + (state * state_weight).sum()
        present = {name: x for name, x in params.items() if x is not None}
        grads = dict(zip(present, torch.autograd.grad(loss, list(present.values()))))
        return o, state, grads

    o, state, grads = run(lambda p: chunk_kda(**p, scale=scale, output_final_state=True, chunk_size=chunk_size))
    o_ref, state_ref, grads_ref = run(
        lambda p: chunk_kda_autograd_reference(
            p["q"], p["k"], p["v"], p["g"], p["beta"], scale, p["initial_state"], True, chunk_size
        )
    )
    assert o.grad_fn is not None and type(o.grad_fn).__name__ != type(o_ref.grad_fn).__name__
    assert max_error(o, o_ref) < 1e-12 and max_error(state, state_ref) < 1e-12
    assert set(grads) == set(grads_ref) == {name for name, x in leaves.items() if x is not None}
    for name in grads:
        assert max_error(grads[name], grads_ref[name]) < 1e-12 * max(1.0, grads_ref[name].abs().max().item()), name


def test_forward_is_the_reference_operations_bit_for_bit_in_fp32():
    # The HF export's standalone remote code repeats these operations to get the same fp32 numbers.
    inputs, initial_state = make_inputs(150, key_dim=64, value_dim=32, gate="bounded", dtype=torch.float32)
    for state in (None, initial_state.float()):
        o, final = chunk_kda(**inputs, scale=0.125, initial_state=state, output_final_state=True)
        o_ref, final_ref = chunk_kda_autograd_reference(*inputs.values(), 0.125, state, True, 64)
        assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


@pytest.mark.parametrize("smallest_beta", [0.0, 1e-30])
def test_hand_written_backward_with_a_vanishing_beta_float64(smallest_beta):
    # dβ divides u by β unless some β is below 1e-20; then it forms v − (k e^G) S − (key Gram) u.
    inputs, initial_state = make_inputs(100, gate="unbounded")
    inputs["beta"][0, 7, 1] = smallest_beta
    leaves = {**inputs, "initial_state": initial_state}

    def gradients(kernel):
        params = {name: x.clone().requires_grad_() for name, x in leaves.items()}
        o, state = kernel(params)
        loss = (o * o.detach().cos()).sum() + state.sum()
        return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))

    scale = 0.25
    grads = gradients(lambda p: chunk_kda(**p, scale=scale, output_final_state=True, chunk_size=32))
    grads_ref = gradients(
        lambda p: chunk_kda_autograd_reference(
            p["q"], p["k"], p["v"], p["g"], p["beta"], scale, p["initial_state"], True, 32
        )
    )
    for name in grads:
        assert max_error(grads[name], grads_ref[name]) < 1e-12 * max(1.0, grads_ref[name].abs().max().item()), name


def test_hand_written_backward_passes_gradcheck():
    # Finite differences in float64 on a small case: two chunks of 8 (tiles of 8 at g > -5),
    # a padded tail, an initial state, and both outputs.
    inputs, initial_state = make_inputs(13, batch=1, heads=2, key_dim=4, value_dim=3)
    names = list(inputs) + ["initial_state"]
    tensors = [x.clone().requires_grad_() for x in [*inputs.values(), initial_state]]

    def kernel(*args):
        return chunk_kda(*args[:5], initial_state=args[5], output_final_state=True, chunk_size=8)

    assert torch.autograd.gradcheck(kernel, tensors, eps=1e-6, atol=1e-8), names


def test_backward_with_only_the_final_state_or_only_the_output_used():
    """A gradient arriving for one output only (the other's is None inside autograd)."""
    inputs, initial_state = make_inputs(40, gate="worst")
    for use in ("output", "state"):
        params = {name: x.clone().requires_grad_() for name, x in {**inputs, "initial_state": initial_state}.items()}
        reference = {name: x.detach().clone().requires_grad_() for name, x in params.items()}
        o, state = chunk_kda(**params, output_final_state=True, chunk_size=16)
        o_ref, state_ref = chunk_kda_autograd_reference(
            reference["q"],
            reference["k"],
            reference["v"],
            reference["g"],
            reference["beta"],
            inputs["q"].shape[-1] ** -0.5,
            reference["initial_state"],
            True,
            16,
        )
        (o.sum() if use == "output" else state.sum()).backward()
        (o_ref.sum() if use == "output" else state_ref.sum()).backward()
        for name in params:
            # (q does not reach the state: autograd leaves its gradient None, this backward zeros)
            expected = reference[name].grad
            expected = torch.zeros_like(params[name]) if expected is None else expected
            assert max_error(params[name].grad, expected) < 1e-12, (use, name)


@pytest.mark.parametrize("kernel", [naive_recurrent_kda, chunk_kda])
def test_state_handover_equals_one_run(kernel):
    inputs, initial_state = make_inputs(100)
    kwargs = {"chunk_size": 32} if kernel is chunk_kda else {}
    o_full, state_full = kernel(**inputs, initial_state=initial_state, output_final_state=True, **kwargs)
    split = 37  # inside a chunk, so the hand-over state comes from a padded run
    first = {name: x[:, :split] for name, x in inputs.items()}
    second = {name: x[:, split:] for name, x in inputs.items()}
    o_first, state_mid = kernel(**first, initial_state=initial_state, output_final_state=True, **kwargs)
    o_second, state_end = kernel(**second, initial_state=state_mid, output_final_state=True, **kwargs)
    assert max_error(torch.cat([o_first, o_second], dim=1), o_full) < 1e-12
    assert max_error(state_end, state_full) < 1e-12


@pytest.mark.parametrize("kernel", [naive_recurrent_kda, chunk_kda])
def test_affine_transition_from_identity_columns(kernel):
    """What context parallelism relies on (parallel/context.py): each value column of the state
    evolves on its own, so one run with K extra zero value columns started from the identity
    gives the maps of `S_out = A S_in + B` and `o = o⁰ + M S_in`; they reproduce the naive
    recurrence from any initial state (here 45 tokens: not a multiple of the 16-token chunk)."""
    inputs, initial_state = make_inputs(45)
    kwargs = {"chunk_size": 16} if kernel is chunk_kda else {}
    batch, _, heads, key_dim = inputs["q"].shape
    value_dim = inputs["v"].shape[-1]
    extended = dict(inputs, v=torch.cat([inputs["v"], inputs["v"].new_zeros(*inputs["v"].shape[:-1], key_dim)], -1))
    identity = torch.eye(key_dim, dtype=F64).expand(batch, heads, key_dim, key_dim)
    start = torch.cat([identity.new_zeros(batch, heads, key_dim, value_dim), identity], dim=-1)
    o, final = kernel(**extended, initial_state=start, output_final_state=True, **kwargs)
    o_zero, query_map = o.split([value_dim, key_dim], dim=-1)
    offset, transition = final.split([value_dim, key_dim], dim=-1)

    o_expected, state_expected = naive_recurrent_kda(**inputs, initial_state=initial_state, output_final_state=True)
    assert max_error(transition @ initial_state + offset, state_expected) < 1e-12
    assert max_error(o_zero + torch.einsum("bthk,bhkv->bthv", query_map, initial_state), o_expected) < 1e-12


@pytest.mark.parametrize("kernel", [naive_recurrent_kda, chunk_kda])
def test_empty_sequence_returns_the_initial_state(kernel):
    inputs, initial_state = make_inputs(0)
    o, state = kernel(**inputs, initial_state=initial_state, output_final_state=True)
    assert o.shape == (2, 0, 2, 8)
    assert torch.equal(state, initial_state)


def test_decayed_gram_matrices_match_pairwise_definition():
    # Every tile size assembles the same matrix, including the bridges between tiles.
    generator = torch.Generator().manual_seed(0)
    chunk, dim = 32, 8
    x = torch.randn(3, chunk, dim, generator=generator, dtype=F64)
    keys = torch.randn(3, chunk, dim, generator=generator, dtype=F64)
    g = -5.0 * torch.rand(3, chunk, dim, generator=generator, dtype=F64)
    log_decay = g.cumsum(dim=-2)
    # Direct definition (float64 takes the positive exponents above the diagonal), then masked.
    pairwise_decay = torch.exp(log_decay[:, :, None, :] - log_decay[:, None, :, :])
    expected = torch.einsum("bic,bjc,bijc->bij", x, keys, pairwise_decay).tril()
    for tile in [1, 2, 4, 8, 16, 32]:
        decay = tile_decay(log_decay, tile, F64)

        def tiled(t: torch.Tensor, tile: int = tile) -> torch.Tensor:
            return t.reshape(3, chunk // tile, tile, dim)

        (gram,) = decayed_gram_matrices(
            [tiled(x) * decay.to_reference], tiled(keys) * decay.from_reference, decay.reference
        )
        assert max_error(gram, expected) < 1e-12, tile


def test_causal_keys_seen_are_the_reached_part_of_keys_seen_from_row_tiles():
    # The training path's packed keys: row tile a's first (a + 1) key tiles, bit for bit, and the
    # same bridges (0 for the later tiles); what it leaves out is exactly 0 in the full form.
    generator = torch.Generator().manual_seed(0)
    chunk, dim = 32, 8
    log_decay = (-5.0 * torch.rand(3, chunk, dim, generator=generator, dtype=F64)).cumsum(dim=-2)
    for tile in [1, 4, 8, 16]:
        decay = tile_decay(log_decay, tile, torch.float32)
        key_columns = torch.randn(3, chunk // tile, tile, dim, generator=generator) * decay.from_reference
        full, bridge = keys_seen_from_row_tiles(key_columns, decay.reference, exp_in_float64=True)
        packed, packed_bridge = causal_keys_seen(key_columns, decay.reference)
        assert torch.equal(packed_bridge, bridge), tile
        for a in range(chunk // tile):
            reached = (a + 1) * tile
            assert torch.equal(causal_keys_seen_of_tile(packed, a, tile), full[..., a, :reached, :]), (tile, a)
            assert not full[..., a, reached:, :].any(), (tile, a)


def test_diagonal_tile_size_follows_the_decay_range():
    # fp32 allows a decay span of 0.9·ln(3.4e38) ≈ 79.8 inside a tile.
    assert diagonal_tile_size(5.0, 64, torch.float32) == 16  # K3's bound: 15·5 = 75
    assert diagonal_tile_size(0.5, 64, torch.float32) == 64
    assert diagonal_tile_size(100.0, 64, torch.float32) == 1
    assert diagonal_tile_size(5.0, 48, torch.float32) == 16  # a divisor, not a power of two
    assert diagonal_tile_size(5.0, 64, F64) == 64


# ------------------------------------------------------------------ fp32 range, bf16
FP32_TOLERANCE = 1e-5
# Why 1e-5: every decay factor is e^x with |x| ≤ 40 rounded once to fp32 (relative error
# ≤ 40·2^-24 ≈ 2.4e-6), entries of the Gram matrices sum K such terms of size ≤ 1, and the
# unit-triangular solve does not amplify them here; the fp32 recurrence itself is off by ~1e-7.
# Observed errors are ~1e-7 (|o| ≲ 1). A range bug (overflow, underflow of O(1) terms, NaN)
# shows as errors of order 1e-2 or more.


@pytest.mark.parametrize("gate", ["worst", "bounded", "unbounded", "none"])
@pytest.mark.parametrize("requires_grad", [False, True])  # the no-grad forward, and ChunkKDA's
def test_fp32_chunk_matches_float64_reference(gate, requires_grad):
    # g = −5 everywhere: e^{G} reaches e^{−320} across a 64-token chunk (docs/design.md §1.1).
    inputs, initial_state = make_inputs(192, batch=1, heads=2, key_dim=64, value_dim=64, gate=gate)
    inputs32 = {name: x.float().requires_grad_(requires_grad) for name, x in inputs.items()}
    o_ref, state_ref = naive_recurrent_kda(
        **{name: x.detach().double() for name, x in inputs32.items()},
        initial_state=initial_state,
        output_final_state=True,
    )
    o, state = chunk_kda(**inputs32, initial_state=initial_state.float(), output_final_state=True)
    assert (o.grad_fn is not None) == requires_grad
    o, state = o.detach(), state.detach()
    assert o.dtype == torch.float32 and state.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert max_error(o, o_ref) < FP32_TOLERANCE
    assert max_error(state, state_ref) < FP32_TOLERANCE


def test_fp32_gradients_stay_finite_and_accurate_at_worst_case_decay():
    inputs, initial_state = make_inputs(128, batch=1, heads=1, key_dim=32, value_dim=32, gate="worst")
    leaves = {**inputs, "initial_state": initial_state}
    generator = torch.Generator().manual_seed(1)
    o_weight = torch.randn(inputs["v"].shape, generator=generator, dtype=F64)

    def gradients(kernel, dtype) -> dict[str, torch.Tensor]:
        params = {name: x.to(dtype).requires_grad_() for name, x in leaves.items()}
        o, state = kernel(**params, output_final_state=True)
        loss = (o * o_weight.to(dtype)).sum() + state.sum()
        return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))

    reference = gradients(naive_recurrent_kda, F64)
    chunked = gradients(chunk_kda, torch.float32)
    for name, grad in chunked.items():
        assert torch.isfinite(grad).all(), name
        scale = reference[name].abs().max().item()
        assert max_error(grad, reference[name]) < 1e-5 * max(scale, 1.0), name


@pytest.mark.parametrize("kernel", [naive_recurrent_kda, chunk_kda])
def test_bf16_inputs_give_bf16_output_close_to_reference(kernel):
    inputs, initial_state = make_inputs(80, gate="bounded", dtype=torch.bfloat16)
    o, state = kernel(**inputs, initial_state=initial_state, output_final_state=True)
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    o_ref, state_ref = naive_recurrent_kda(
        **{name: x.double() for name, x in inputs.items()},
        initial_state=initial_state.double(),
        output_final_state=True,
    )
    # Accumulation is fp32 on the same (bf16-rounded) inputs; what remains is the final rounding
    # of o to bf16 (8 significant bits, relative 2^-9 ≈ 2e-3).
    assert max_error(o, o_ref) < 4e-3 * o_ref.abs().max().item()
    assert max_error(state, state_ref) < 1e-5


def test_chunk_kda_under_bf16_autocast_keeps_its_own_precision():
    # The model runs under bf16 autocast; the kernel's matmuls stay in its fp32 compute dtype.
    inputs, initial_state = make_inputs(40, dtype=torch.float32)
    params = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, state = chunk_kda(**params, initial_state=initial_state.float(), output_final_state=True, chunk_size=16)
    # (the same path without autocast: the forward that keeps what its backward needs)
    reference = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    o_ref, state_ref = chunk_kda(
        **reference, initial_state=initial_state.float(), output_final_state=True, chunk_size=16
    )
    assert o.dtype == state.dtype == torch.float32
    assert torch.equal(o, o_ref) and torch.equal(state, state_ref)
    (o.sum() + state.sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in params.values())


# ------------------------------------------------------------------ gates
def gate_inputs(dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(0)
    heads, key_dim = 3, 4
    z = torch.randn(2, 5, heads, key_dim, generator=generator).to(dtype)
    A_log = torch.log(torch.tensor([0.5, 1.0, 2.0]))  # moderate rates keep sigmoid unsaturated
    dt_bias = torch.randn(heads * key_dim, generator=generator)
    return z, A_log, dt_bias


def test_bounded_gate_formula_and_range():
    z, A_log, dt_bias = gate_inputs()
    for lower_bound in (-5.0, -2.0):
        g = kda_gate(z, A_log, dt_bias, lower_bound=lower_bound)
        assert g.dtype == torch.float32 and g.shape == z.shape
        assert (g > lower_bound).all() and (g < 0).all()
        for head in range(3):  # head h uses A_log[h] and dt_bias[h*K:(h+1)*K]
            argument = A_log[head].exp() * (z[:, :, head] + dt_bias[4 * head : 4 * head + 4])
            torch.testing.assert_close(g[:, :, head], lower_bound * torch.sigmoid(argument))
    # Saturated inputs reach the closed ends in fp32, never beyond.
    extreme = kda_gate(torch.full_like(z, 1e4), A_log, dt_bias)
    assert (extreme >= -5.0).all() and torch.isfinite(extreme).all()


def test_unbounded_gate_formula_and_sign():
    z, A_log, dt_bias = gate_inputs(torch.bfloat16)
    g = kda_gate_unbounded(z, A_log, dt_bias)
    assert g.dtype == torch.float32 and (g <= 0).all()
    for head in range(3):
        argument = z[:, :, head].float() + dt_bias[4 * head : 4 * head + 4]
        torch.testing.assert_close(g[:, :, head], -A_log[head].exp() * F.softplus(argument))


def test_gates_reject_wrong_parameter_shapes():
    z, A_log, dt_bias = gate_inputs()
    with pytest.raises(ValueError):
        kda_gate(z, A_log[:2], dt_bias)
    with pytest.raises(ValueError):
        kda_gate_unbounded(z, A_log, dt_bias[:-1])


# ------------------------------------------------------------------ fla dispatch
FLA_IMPORT_PROBE = """
import importlib.abc, json, sys

class Recorder(importlib.abc.MetaPathFinder):
    attempts = []

    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] in ("fla", "triton"):
            self.attempts.append(fullname)
        return None  # let the import go on: where fla is installed it would land in sys.modules

sys.meta_path.insert(0, Recorder())
import torch
from k3train.kernels.kda import chunk_kda
from k3train.kernels.kda import chunk as chunk_module
from k3train.kernels.kda import fla_backend

x = torch.randn(1, 20, 2, 8)
chunk_kda(x, x, x, -x.abs(), torch.rand(1, 20, 2), output_final_state=True)  # backend="auto"
print(json.dumps({
    "attempts": Recorder.attempts,
    "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in ("fla", "triton")),
    "loader_calls": fla_backend.load_fla_chunk_kda.cache_info().misses,
}))
"""


def test_cpu_never_imports_fla():
    # A fresh interpreter, so that an import at module level counts as much as one in the call.
    checkout = str(pathlib.Path(__file__).resolve().parents[2])
    result = subprocess.run(
        [sys.executable, "-c", FLA_IMPORT_PROBE, checkout],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"attempts": [], "loaded": [], "loader_calls": 0}


def test_backend_selection_rules():
    inputs, _ = make_inputs(4, dtype=torch.float32)
    tensors = list(inputs.values())
    assert fla_backend.use_fla_backend("torch", *tensors) is False
    assert fla_backend.use_fla_backend("auto", *tensors) is False  # CPU tensors
    with pytest.raises(ValueError):
        fla_backend.use_fla_backend("fla", *tensors)  # fla needs CUDA tensors
    with pytest.raises(ValueError):
        chunk_kda(**inputs, backend="triton")


def test_fla_call_passes_layouts_and_fp32_state(monkeypatch):
    # The call into fla itself, with a stand-in for fla.ops.kda.chunk_kda (no CUDA here).
    calls = []

    def fake_fla_chunk_kda(q, k, v, g, beta, **kwargs):
        calls.append(((q, k, v, g, beta), kwargs))
        return v.clone(), None

    monkeypatch.setattr(fla_backend, "load_fla_chunk_kda", lambda: fake_fla_chunk_kda)
    inputs, initial_state = make_inputs(4, dtype=torch.bfloat16)
    o, _ = fla_backend.run_fla_chunk_kda(
        *inputs.values(), scale=0.25, initial_state=initial_state, output_final_state=True
    )
    ((positional, kwargs),) = calls
    assert all(a is b for a, b in zip(positional, inputs.values()))  # same layouts, no copies
    assert kwargs["scale"] == 0.25 and kwargs["output_final_state"] is True
    assert kwargs["initial_state"].dtype == torch.float32
    assert torch.equal(kwargs["initial_state"], initial_state.float())
    assert torch.equal(o, inputs["v"])


def test_input_shapes_are_checked():
    inputs, initial_state = make_inputs(10)
    with pytest.raises(ValueError):
        chunk_kda(**{**inputs, "beta": inputs["beta"][..., None]})
    with pytest.raises(ValueError):
        naive_recurrent_kda(**inputs, initial_state=initial_state.transpose(-1, -2))


@pytest.mark.parametrize("caller_flushes", [False, True])
def test_chunk_kda_restores_the_callers_denormal_mode(caller_flushes):
    """The PyTorch path runs in flush-to-zero mode on CPU (subnormal decay products otherwise
    stall the matmuls) and hands the caller's mode back after forward and after backward."""
    from k3train.kernels.kda.tiles import flushes_denormals as _flushes_denormals

    generator = torch.Generator().manual_seed(0)
    shape = (1, 40, 2, 8)
    q, k = (F.normalize(torch.randn(shape, generator=generator), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(shape, generator=generator, requires_grad=True)
    g = (-5.0 * torch.rand(shape, generator=generator)).requires_grad_()
    beta = torch.rand(shape[:3], generator=generator, requires_grad=True)
    torch.set_flush_denormal(caller_flushes)
    try:
        o, state = chunk_kda(q, k, v, g, beta, output_final_state=True, chunk_size=16, backend="torch")
        assert _flushes_denormals() == caller_flushes
        (o.square().sum() + state.sum()).backward()
        assert _flushes_denormals() == caller_flushes
        assert all(torch.isfinite(x.grad).all() for x in (q, k, v, g, beta))
    finally:
        torch.set_flush_denormal(False)


# ---------------------------------------------------------------------- KDA from raw inputs
def _raw_inputs(seq_len: int, dtype=F64, seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    batch, heads, key_dim, value_dim = 2, 2, 16, 8

    def randn(*shape):
        return torch.randn(shape, generator=generator, dtype=dtype)

    shape = (batch, seq_len, heads, key_dim)
    return dict(
        q=randn(*shape),
        k=randn(*shape),
        v=randn(batch, seq_len, heads, value_dim),
        gate_input=randn(*shape),
        beta_logits=randn(batch, seq_len, heads),
        A_log=0.5 * randn(heads),
        dt_bias=randn(heads * key_dim),
        initial_state=randn(batch, heads, key_dim, value_dim),
    )


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunk_kda_from_raw_is_the_definition_on_raw_inputs(lower_bound):
    """The PyTorch path of `chunk_kda_from_raw` against the token-by-token recurrence on the
    definitions of its steps (FLA's l2norm, the gate, β's sigmoid), values and every gradient, in
    float64 (the chunkwise form against the recurrence: 1e-12 elsewhere in this file)."""
    from k3train.kernels.kda import kda_gate_reference, kda_gate_unbounded_reference
    from k3train.kernels.kda.raw_inputs import chunk_kda_from_raw
    from k3train.kernels.norms import l2_normalize_reference

    inputs = {name: x.requires_grad_() for name, x in _raw_inputs(37).items()}
    q, k, v, z, b, a_log, dt_bias, state = inputs.values()

    def definition():
        g = (
            kda_gate_reference(z, a_log, dt_bias, lower_bound)
            if lower_bound is not None
            else kda_gate_unbounded_reference(z, a_log, dt_bias)
        )
        return naive_recurrent_kda(
            l2_normalize_reference(q),
            l2_normalize_reference(k),
            v,
            g,
            torch.sigmoid(b),
            initial_state=state,
            output_final_state=True,
        )

    def fast():
        return chunk_kda_from_raw(
            q,
            k,
            v,
            z,
            b,
            a_log,
            dt_bias,
            lower_bound,
            initial_state=state,
            output_final_state=True,
            chunk_size=16,
            backend="torch",
        )

    def values_and_grads(run):
        o, final = run()
        loss = (o * torch.linspace(-1, 1, o.numel(), dtype=F64).view(o.shape)).sum() + final.square().sum()
        return [o, final, *torch.autograd.grad(loss, list(inputs.values()))]

    for got, want in zip(values_and_grads(fast), values_and_grads(definition)):
        assert (got - want).abs().max() < 1e-11 * max(1.0, want.abs().max().item())


def test_chunk_kda_from_raw_dispatch(monkeypatch):
    """On CPU tensors, "auto" and "torch" compute the steps and then `chunk_kda`; where fla would
    run, "auto" hands it the raw inputs with every fused step switched on, unless fla's bounded
    gate does not take the lower bound (then the steps run here and fla gets the plain kernel)."""
    from k3train.kernels.kda import raw_inputs

    inputs = _raw_inputs(8, dtype=torch.float32)
    fused_calls, plain_calls = [], []

    def fake_fla_chunk_kda(q, k, v, g, beta, **kwargs):
        (fused_calls if kwargs.get("use_gate_in_kernel") else plain_calls).append(((q, k, v, g, beta), kwargs))
        return v.clone(), None

    values = list(inputs.values())
    torch_path = raw_inputs.chunk_kda_from_raw(*values[:7], -5.0)  # CPU: the PyTorch path
    fla_backend.fla_takes_raw_inputs.cache_clear()
    monkeypatch.setattr(fla_backend, "load_fla_chunk_kda", lambda: fake_fla_chunk_kda)
    monkeypatch.setattr(fla_backend, "fla_takes_raw_inputs", lambda: True)
    monkeypatch.setattr(fla_backend, "use_fla_backend", lambda backend, *tensors: backend != "torch")
    raw_inputs.chunk_kda_from_raw(*values[:7], -5.0, scale=0.5, initial_state=values[7], output_final_state=True)
    ((positional, kwargs),) = fused_calls
    assert all(a is b for a, b in zip(positional, values[:5]))  # q, k, v, gate input, β logits as given
    assert kwargs["use_qk_l2norm_in_kernel"] and kwargs["use_gate_in_kernel"] and kwargs["use_beta_sigmoid_in_kernel"]
    assert kwargs["safe_gate"] is False and kwargs["lower_bound"] == -5.0 and kwargs["scale"] == 0.5
    assert kwargs["A_log"] is values[5] and kwargs["dt_bias"] is values[6]
    assert kwargs["initial_state"].dtype == torch.float32 and kwargs["output_final_state"] is True
    raw_inputs.chunk_kda_from_raw(*values[:7], None)  # the unbounded gate: fused too
    assert fused_calls[-1][1]["safe_gate"] is False and fused_calls[-1][1]["lower_bound"] is None
    raw_inputs.chunk_kda_from_raw(*values[:7], -8.0)  # any bound without safe_gate
    assert fused_calls[-1][1]["lower_bound"] == -8.0
    raw_inputs.chunk_kda_from_raw(*values[:7], -5.0, fla_safe_gate=True)  # opt-in
    assert fused_calls[-1][1]["safe_gate"] is True and fused_calls[-1][1]["lower_bound"] == -5.0
    with pytest.raises(ValueError, match=r"\[-5.0, 0.0\)"):
        raw_inputs.chunk_kda_from_raw(*values[:7], -8.0, fla_safe_gate=True)
    with pytest.raises(ValueError, match=r"\[-5.0, 0.0\)"):
        raw_inputs.chunk_kda_from_raw(*values[:7], None, fla_safe_gate=True)
    assert len(fused_calls) == 4 and not plain_calls
    o, _ = raw_inputs.chunk_kda_from_raw(*values[:7], -5.0, backend="torch")
    assert len(fused_calls) == 4 and torch.equal(o, torch_path[0])
    monkeypatch.setattr(fla_backend, "fla_takes_raw_inputs", lambda: False)  # an older fla: steps here
    raw_inputs.chunk_kda_from_raw(*values[:7], -8.0)
    ((positional, kwargs),) = plain_calls
    assert "use_gate_in_kernel" not in kwargs
    assert torch.allclose(positional[3], kda_gate(values[3], values[5], values[6], lower_bound=-8.0))


def test_an_fla_without_the_raw_input_keywords_gets_the_unfused_steps(monkeypatch):
    """fla's `chunk_kda` takes `**kwargs`: a release that does not name the raw-input keywords
    would ignore them silently, so it is recognised by its signature (and a release before 0.6.0,
    whose `A_log`/`dt_bias` no signature shows, by its version) and given the normalised inputs
    instead."""
    from k3train.kernels.kda import raw_inputs

    calls = []

    def old_fla_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kwargs):
        calls.append(kwargs)
        return v.clone(), None

    def new_fla_chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        use_gate_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        safe_gate=False,
        lower_bound=None,
        **kwargs,
    ):
        return v.clone(), None

    values = list(_raw_inputs(8, dtype=torch.float32).values())
    monkeypatch.setattr(fla_backend, "use_fla_backend", lambda backend, *tensors: backend != "torch")
    for fla, version, takes in (
        (old_fla_chunk_kda, "0.6.0", False),
        (new_fla_chunk_kda, "0.6.0", True),
        (new_fla_chunk_kda, "0.10.1", True),
        (new_fla_chunk_kda, "0.5.9", False),
        (new_fla_chunk_kda, None, False),
    ):
        fla_backend.fla_takes_raw_inputs.cache_clear()
        monkeypatch.setattr(fla_backend, "load_fla_chunk_kda", lambda fla=fla: fla)
        monkeypatch.setattr(fla_backend, "installed_fla_version", lambda version=version: version)
        assert fla_backend.fla_takes_raw_inputs() is takes, (fla.__name__, version)
    fla_backend.fla_takes_raw_inputs.cache_clear()
    monkeypatch.setattr(fla_backend, "load_fla_chunk_kda", lambda: old_fla_chunk_kda)
    raw_inputs.chunk_kda_from_raw(*values[:7], -5.0)
    assert calls == [{}]  # the plain kernel, on normalised and gated inputs
    with pytest.raises(RuntimeError, match="upgrade fla-core"):
        fla_backend.run_fla_chunk_kda_from_raw(*values[:7], -5.0, 0.5, None, False)
    fla_backend.fla_takes_raw_inputs.cache_clear()
