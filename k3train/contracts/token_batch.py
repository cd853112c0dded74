"""The rows a training or evaluation step reads: token ids and what the model and loss need to
know about the documents packed into them.

`TokenBatch` is what the data pipeline yields and what a pipeline micro-batch is: `tokens`
`[rows, seq + 1]` (inputs `[:, :-1]`, labels `[:, 1:]`), and, when the run asks for them,
`document_starts` `[rows, seq]` (True at the first input token of every packed document and at
position 0 of every row; `data.document_boundaries=reset`) and `loss_mask` `[rows, seq]` (False
where a label is not trained on; `data.eod_mask_loss`). Both cover whole sequences, also under
context parallelism, where the model keeps its own pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenBatch:
    """Token rows with their document starts and loss mask (each None when not asked for)."""

    tokens: torch.Tensor
    document_starts: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[:, :-1]

    @property
    def labels(self) -> torch.Tensor:
        return self.tokens[:, 1:]

    def split(self, rows: int) -> list[TokenBatch]:
        """Micro-batches of `rows` rows each (the last may be shorter), as `Tensor.split`."""
        parts = [t.split(rows) if t is not None else None for t in (self.tokens, self.document_starts, self.loss_mask)]
        tokens, starts, mask = parts
        assert tokens is not None
        return [
            TokenBatch(
                piece,
                starts[index] if starts is not None else None,
                mask[index] if mask is not None else None,
            )
            for index, piece in enumerate(tokens)
        ]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TokenBatch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        tokens = move(self.tokens)
        assert tokens is not None
        return TokenBatch(tokens, move(self.document_starts), move(self.loss_mask))


def token_rows(batch: torch.Tensor | TokenBatch) -> torch.Tensor:
    """The token ids of a micro-batch given as a plain tensor or a `TokenBatch`."""
    return batch.tokens if isinstance(batch, TokenBatch) else batch


__all__ = ["TokenBatch", "token_rows"]
