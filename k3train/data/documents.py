"""Document boundaries of packed rows: the starts the model resets at, and the end-of-document
loss mask (Megatron's `--reset-attention-mask` and `--eod-mask-loss`).

Packing (`samples.py`) lays documents end to end, each followed by an eos. With
`data.document_boundaries=reset` a row carries, for each input position, whether a document
begins there, read from the dataset's document index (a document's first token), plus position
0 of every row, where the model's stream begins anyway. With `data.eod_mask_loss` the label of
every input that is the eos token (the next document's first token, which nothing in the
finished document predicts) is not trained on.
"""

from __future__ import annotations

import torch

from k3train.contracts.token_batch import TokenBatch


def token_batch(
    tokens: torch.Tensor, starts: torch.Tensor, eos_id: int, *, reset: bool, eod_mask_loss: bool
) -> TokenBatch:
    """`tokens [rows, seq + 1]` and the document index's `starts [rows, seq]` as a `TokenBatch`
    with what the run asks for."""
    document_starts = None
    if reset:
        document_starts = starts.clone()
        document_starts[:, 0] = True
    loss_mask = tokens[:, :-1] != eos_id if eod_mask_loss else None
    return TokenBatch(tokens, document_starts, loss_mask)


def document_lengths(document_starts: torch.Tensor) -> list[list[int]]:
    """The lengths of the documents of every row of `document_starts [rows, seq]` (position 0
    starts one whatever it says)."""
    seq = document_starts.shape[1]
    lengths = []
    for row in document_starts.to(torch.bool).cpu():
        begins = [0] + [int(i) for i in torch.nonzero(row[1:]).flatten() + 1]
        lengths.append([end - begin for begin, end in zip(begins, begins[1:] + [seq])])
    return lengths


__all__ = ["document_lengths", "token_batch"]
