"""The pieces of `parallel.ep_overlap_halves` that need no process group: the driver that
alternates phase generators, and the split of a residual state into two halves of its sequences
(block keys included) and back."""

import torch

from k3train.model.attn_res import KeyedResidualState
from k3train.model.k3 import halves_of, joined
from k3train.parallel.expert_exchange import alternate, run_phases


def _phases(name: str, yields: int, log: list[str]):
    for step in range(yields):
        log.append(f"{name}{step}")
        yield "exchange"
    log.append(f"{name} done")
    return name.upper()


def test_alternate_runs_each_generator_to_its_next_yield_in_turn():
    log: list[str] = []
    results = alternate([_phases("a", 2, log), _phases("b", 3, log)])
    assert results == ["A", "B"]
    # a to its first yield, then b, then each resumed in turn; the shorter one ends first
    assert log == ["a0", "b0", "a1", "b1", "a done", "b2", "b done"]


def test_a_phase_generator_run_at_once_is_the_plain_call():
    log: list[str] = []
    assert run_phases(_phases("a", 3, log)) == "A" and log == ["a0", "a1", "a2", "a done"]


def test_halves_split_at_a_sequence_and_join_back_with_their_keys():
    rows, seq, width = 3, 4, 5  # an odd batch: the first half takes two sequences
    partial = torch.randn(rows, seq, width)
    blocks = [torch.randn(rows, seq, width) for _ in range(2)]
    mix = object()
    keys = [None, (1e-6, torch.randn(rows * seq), {id(mix): torch.randn(rows * seq)})]  # flat over the tokens
    state = KeyedResidualState(partial, blocks, keys)
    first, second = halves_of(state)
    assert first.partial.shape[0] == 2 and second.partial.shape[0] == 1
    assert torch.equal(first.blocks[1], blocks[1][:2]) and torch.equal(second.blocks[0], blocks[0][2:])
    # a token's key stays with its sequence: the first 2 · seq entries go with the first half
    assert torch.equal(first.block_keys[1][1], keys[1][1][: 2 * seq])
    assert torch.equal(second.block_keys[1][2][id(mix)], keys[1][2][id(mix)][2 * seq :])
    assert first.block_keys[0] is None
    back = joined([first, second])
    assert torch.equal(back.partial, partial) and all(torch.equal(a, b) for a, b in zip(back.blocks, blocks))
    assert back.block_keys[0] is None and torch.equal(back.block_keys[1][1], keys[1][1])
    assert torch.equal(back.block_keys[1][2][id(mix)], keys[1][2][id(mix)])
