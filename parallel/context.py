"""Context parallelism: every sequence split over the `cp` ranks, with the KDA recurrence, the
short convolutions and MLA's causal attention crossing the shard boundaries exactly.

The layout. A sequence of `T` tokens is cut into `2C` equal pieces (`C` = cp size, piece length
`L = T / 2C`); cp rank `r` holds piece `r` (its front) and piece `2C − 1 − r` (its back),
concatenated in that order. Causal attention then costs every rank the same: a front piece sees
few keys, its back piece many (Megatron's and torchtitan's load-balanced sharding). Everything
per token (embeddings, norms, AttnRes over depth, MoE routing, the head) runs on the local
`2L` tokens unchanged; only the token mixers look across pieces:

- KDA, per piece. The short convolutions need the last `kernel − 1` projected inputs of the
  piece before (`previous_tails`). The recurrence is affine in the state entering a piece:
  with everything else fixed, `S_out = A · S_in + B` (`A` is `[K, K]` per head, since the
  delta rule acts on the state from the left) and `o = o⁰ + M · S_in`. One kernel call per
  piece computes all of it at once: the value columns are extended by `K` columns of zeros and
  the initial state by the identity, so the kernel's extra output columns are `M` and its extra
  final-state columns are `A` (each value column of the recurrence evolves independently).
  Every piece runs this at once; then only states cross ranks, in sequence order
  (`state_exchange="handoff"`, the default: `S_out = A S_in + B` handed from piece to piece,
  one `[H, K, V]` state per boundary, backward in reverse), or every piece's `(A, B)` is
  all-gathered and folded locally (`"gather"`: one collective, 2C maps of `[H, K, K + V]`).
  Finally `o = o⁰ + M · S_in`. Why: docs/context_parallel.md.
- MLA. The compressed KV (`kv_a` output: `kv_lora_rank + qk_rope_head_dim` per token, shared by
  every head) is all-gathered over cp into true order (backward: reduce-scatter), up-projected
  locally, and each local piece attends the keys up to its own end under a lower-right causal
  mask (no mask tensor: the causal minimum of scores, flash attention on CUDA).

Packed documents (`document_starts`, the whole sequence's, on every cp rank): a piece is cut
into its documents, each run as a sequence of its own; a piece's first document continues from
the piece before unless the piece begins one, so the state handed across a boundary is used only
up to the first document start in the piece (`A = 0`, `M = 0` after it), and a convolution tail
keeps only the inputs of the document it continues. MLA's piece masks add "same document".

With a cp group of size 1 nothing here is called; `ContextParallel.single()` is the identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from k3train.kernels.kda import chunk_kda
from k3train.kernels.kda.varlen import chunk_kda_varlen
from k3train.kernels.precision import without_autocast
from k3train.kernels.segments import segment_ids, segment_offsets
from k3train.parallel.comm import Group, TrafficCounter

SEQUENCE_DIM = 1


class _GatherPieces(torch.autograd.Function):
    """All-gather along dim 0 over the cp group (rank order); backward sums every rank's
    gradient and keeps this rank's slice (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group: Group):
        ctx.group = group
        return group.all_gather(x.contiguous(), dim=0)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.reduce_scatter(grad.contiguous(), dim=0), None


class _HandOffStates(torch.autograd.Function):
    """The states entering this rank's two pieces, handed from piece to piece in sequence order.

    Forward: the front chain runs up the ranks (piece r gets rank r − 1's leaving state), rank
    C − 1 turns round into its own back piece, and the back chain runs down (piece 2C − 1 − r gets
    rank r + 1's). Backward runs the same chain in reverse with the adjoint map
    `Ē = g + Aᵀ X̄` (X = A E + B), all inside this one function, so each rank's autograd engine
    issues the chain's sends and receives in one fixed order (a receive in one rank's backward
    never waits on a later node of another's)."""

    @staticmethod
    def forward(ctx, transition, offset, cp: ContextParallel):
        group, rank, last = cp.group, cp.rank, cp.size - 1
        entering_front = torch.zeros_like(offset[0]) if rank == 0 else group.recv(torch.empty_like(offset[0]), rank - 1)
        leaving_front = transition[0] @ entering_front + offset[0]
        if rank < last:
            group.send(leaving_front, rank + 1)
            entering_back = group.recv(torch.empty_like(offset[1]), rank + 1)
        else:
            entering_back = leaving_front  # piece C − 1 is followed by piece C, on this rank
        leaving_back = transition[1] @ entering_back + offset[1]
        if rank > 0:
            group.send(leaving_back, rank - 1)
        entering = torch.stack([entering_front, entering_back])
        ctx.save_for_backward(transition, entering)
        ctx.cp = cp
        return entering

    @staticmethod
    def backward(ctx, grad_entering):
        transition, entering = ctx.saved_tensors
        cp = ctx.cp
        group, rank, last = cp.group, cp.rank, cp.size - 1
        grad_entering = grad_entering.contiguous()
        # The back piece first: its leaving state entered rank r − 1's back piece (rank 0's is the last piece).
        leaving_back_grad = (
            torch.zeros_like(grad_entering[1])
            if rank == 0
            else group.recv(torch.empty_like(grad_entering[1]), rank - 1)
        )
        entering_back_grad = grad_entering[1] + transition[1].mT @ leaving_back_grad
        if rank < last:
            group.send(entering_back_grad, rank + 1)
            leaving_front_grad = group.recv(torch.empty_like(grad_entering[0]), rank + 1)
        else:
            leaving_front_grad = entering_back_grad
        entering_front_grad = grad_entering[0] + transition[0].mT @ leaving_front_grad
        if rank > 0:
            group.send(entering_front_grad, rank - 1)
        grad_transition = torch.stack([leaving_front_grad @ entering[0].mT, leaving_back_grad @ entering[1].mT])
        return grad_transition, torch.stack([leaving_front_grad, leaving_back_grad]), None


STATE_EXCHANGES = ("handoff", "gather")


class ContextParallel:
    """The cp group and the sequence layout: what the model's token mixers and loss need.

    `state_exchange`: how the KDA states cross the pieces, "handoff" (piece to piece, one
    `[H, K, V]` state per boundary) or "gather" (every piece's affine map to every rank, one
    collective); docs/context_parallel.md compares them."""

    def __init__(self, group: Group, state_exchange: str = "handoff"):
        if state_exchange not in STATE_EXCHANGES:
            raise ValueError(f"state_exchange must be one of {STATE_EXCHANGES}, got {state_exchange!r}")
        self.group = group
        self.state_exchange = state_exchange

    @classmethod
    def single(cls) -> ContextParallel:
        return cls(Group("cp", (0,), 0, None, TrafficCounter()))

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def num_pieces(self) -> int:
        return 2 * self.size

    def local_pieces(self, rank: int | None = None) -> tuple[int, int]:
        """The indices (in sequence order) of the front and back piece of cp rank `rank`."""
        rank = self.rank if rank is None else rank
        return rank, self.num_pieces - 1 - rank

    def _piece_order(self) -> list[int]:
        """For each piece in sequence order, its index among the gathered `(rank, slot)` pieces."""
        order = [0] * self.num_pieces
        for rank in range(self.size):
            for slot, piece in enumerate(self.local_pieces(rank)):
                order[piece] = 2 * rank + slot
        return order

    # ------------------------------------------------------------------ the sequence layout
    def shard_sequence(self, x: torch.Tensor, dim: int = SEQUENCE_DIM) -> torch.Tensor:
        """This rank's front and back piece of a whole-sequence tensor (token ids, labels)."""
        if self.size == 1:
            return x
        length = x.shape[dim]
        if length % self.num_pieces:
            raise ValueError(
                f"sequence of {length} tokens does not split into 2*cp = {self.num_pieces} pieces "
                f"(data.seq_length must be divisible by {self.num_pieces})"
            )
        pieces = x.chunk(self.num_pieces, dim=dim)
        front, back = self.local_pieces()
        return torch.cat([pieces[front], pieces[back]], dim=dim)

    def positions(self, local_length: int, device=None) -> torch.Tensor:
        """True sequence positions of the `local_length` local tokens (front piece, then back)."""
        piece = local_length // 2
        front, back = self.local_pieces()
        return torch.cat(
            [
                torch.arange(front * piece, (front + 1) * piece, device=device),
                torch.arange(back * piece, (back + 1) * piece, device=device),
            ]
        )

    def split_pieces(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, 2L, ...]` → `[2B, L, ...]`: the front pieces of the batch, then the back pieces,
        each a sequence of its own for the token mixer."""
        batch, local = x.shape[:2]
        return (
            x.reshape(batch, 2, local // 2, *x.shape[2:]).transpose(0, 1).reshape(2 * batch, local // 2, *x.shape[2:])
        )

    def merge_pieces(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of `split_pieces`."""
        batch, piece = x.shape[0] // 2, x.shape[1]
        return x.reshape(2, batch, piece, *x.shape[2:]).transpose(0, 1).reshape(batch, 2 * piece, *x.shape[2:])

    def gather_pieces(self, local: torch.Tensor) -> torch.Tensor:
        """`[2, ...]` (this rank's front and back) → `[2C, ...]`, every piece in sequence order."""
        gathered = _GatherPieces.apply(local, self.group)
        return gathered[self._piece_order()]

    # ------------------------------------------------------------------ exchanges
    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, 2L, D]` local tokens → `[B, T, D]`, the whole sequence in true order (MLA's
        compressed KV). Backward: each rank gets back the gradient of its own tokens, summed
        over every rank's use of them."""
        batch, local = x.shape[:2]
        pieces = self.gather_pieces(x.reshape(batch, 2, local // 2, *x.shape[2:]).transpose(0, 1))
        return pieces.transpose(0, 1).reshape(batch, self.num_pieces * (local // 2), *x.shape[2:])

    def tail_mask(self, document_starts: torch.Tensor, width: int) -> torch.Tensor:
        """`[2B, 1, width]` bool (`split_pieces` order): which of the `width` inputs before each
        local piece belong to the document its first token is in (none where the piece begins a
        document: no document start may lie after the input and at or before the piece's start)."""
        batch, total = document_starts.shape
        piece = total // self.num_pieces
        masks = []
        for index in self.local_pieces():
            begin = index * piece
            # window[i]: whether true position begin − width + 1 + i starts a document
            window = document_starts.new_zeros(batch, width, dtype=torch.bool)
            lo = max(begin - width + 1, 0)
            window[:, width - (begin + 1 - lo) :] = document_starts[:, lo : begin + 1]
            # input j (position begin − width + j) is kept iff no start in window[j:]
            later_starts = torch.flip(torch.cumsum(torch.flip(window.to(torch.int64), [1]), 1), [1])
            masks.append(later_starts == 0)
        return torch.cat(masks).unsqueeze(1)

    def previous_tails(self, pieces: torch.Tensor, width: int) -> torch.Tensor:
        """The last `width` inputs of the piece before each local piece (zeros before the first),
        channels first as `ShortConvolution` takes them: `[2B, L, C]` → `[2B, C, width]`."""
        batch = pieces.shape[0] // 2
        if pieces.shape[1] < width:
            raise ValueError(
                f"pieces of {pieces.shape[1]} tokens are shorter than a convolution tail of {width}; "
                f"lower parallel.cp or raise data.seq_length"
            )
        tails = pieces[:, pieces.shape[1] - width :].reshape(2, batch, width, pieces.shape[2])
        every = self.gather_pieces(tails)  # [2C, B, width, C] in sequence order
        every = torch.cat([torch.zeros_like(every[:1]), every[:-1]])  # piece p gets piece p − 1's tail
        front, back = self.local_pieces()
        return every[[front, back]].reshape(2 * batch, width, pieces.shape[2]).transpose(1, 2)

    def entering_states(self, transition: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """States entering the local pieces, from every piece's `S_out = A · S_in + B`.

        `transition` `A`: `[2B, H, K, K]`, `offset` `B`: `[2B, H, K, V]` (local pieces in
        `split_pieces` order). Returns `[2B, H, K, V]`; the sequence starts from zeros."""
        batch = transition.shape[0] // 2
        key_dim = transition.shape[-1]
        if self.state_exchange == "handoff":
            entering = _HandOffStates.apply(
                transition.reshape(2, batch, *transition.shape[1:]).contiguous(),
                offset.reshape(2, batch, *offset.shape[1:]).contiguous(),
                self,
            )
            return entering.reshape(offset.shape)
        local = torch.cat([transition, offset], dim=-1).reshape(2, batch, *offset.shape[1:3], -1)
        every = self.gather_pieces(local)  # [2C, B, H, K, K + V]
        front, back = self.local_pieces()
        state = torch.zeros_like(every[0][..., key_dim:])
        entering = {}
        for piece in range(max(front, back) + 1):
            entering[piece] = state
            state = every[piece][..., :key_dim] @ state + every[piece][..., key_dim:]
        return torch.cat([entering[front], entering[back]])

    def chunk_kda(
        self,
        q,
        k,
        v,
        g,
        beta,
        chunk_size: int,
        scale: float | None = None,
        piece_starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """KDA over the local pieces (`split_pieces` layout, `[2B, L, H, *]`) as if the whole
        sequence ran in order; returns `o` `[2B, L, H, V]` in `v.dtype`. `piece_starts`
        (`[2B, L]` bool, or None): where documents begin, the state starts afresh."""
        pieces, length, heads, key_dim = q.shape
        value_dim = v.shape[-1]
        dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
        # Columns V..V+K: zero values from the identity state give the maps M (outputs) and A (state).
        extended_v = torch.cat([v.to(dtype), v.new_zeros(*v.shape[:-1], key_dim, dtype=dtype)], dim=-1)
        identity = torch.eye(key_dim, dtype=dtype, device=v.device).expand(pieces, heads, key_dim, key_dim)
        start = torch.cat([identity.new_zeros(pieces, heads, key_dim, value_dim), identity], dim=-1)
        if piece_starts is None:
            o, final = chunk_kda(
                q,
                k,
                extended_v,
                g,
                beta,
                scale=scale,
                initial_state=start,
                output_final_state=True,
                chunk_size=chunk_size,
            )
        else:
            o, final = self._documents_kda(q, k, extended_v, g, beta, start, piece_starts, chunk_size, scale)
        assert final is not None, "chunk_kda returns the final state when asked for it"
        o_zero, query_map = o.split([value_dim, key_dim], dim=-1)
        # The states cross the pieces in fp32 (float64 for float64 inputs), also under bf16 autocast.
        with without_autocast(v.device):
            offset, transition = final.to(dtype).split([value_dim, key_dim], dim=-1)
            entering = self.entering_states(transition, offset)
            o = o_zero.to(dtype) + torch.einsum("bthk,bhkv->bthv", query_map.to(dtype), entering)
        return o.to(v.dtype)

    @staticmethod
    def _documents_kda(q, k, extended_v, g, beta, start, piece_starts, chunk_size, scale):
        """The extended run over the documents of every piece: a piece's first document starts
        from `start` (`[0 | I]`) unless the piece begins a document, every other document from
        zeros (its columns of `M` and `A` are then zero); the piece's final state is its last
        document's."""
        pieces, length = q.shape[:2]
        cu_seqlens = segment_offsets(piece_starts)
        segments = len(cu_seqlens) - 1
        first = torch.searchsorted(cu_seqlens, torch.arange(pieces, device=q.device) * length)
        last = torch.cat([first[1:], first.new_tensor([segments])]) - 1
        continues = ~piece_starts[:, 0].to(torch.bool)
        initial = start.new_zeros(segments, *start.shape[1:])
        initial = initial.index_copy(0, first, start * continues.to(start.dtype)[:, None, None, None])

        def flat(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(1, pieces * length, *t.shape[2:])

        o, final = chunk_kda_varlen(
            flat(q),
            flat(k),
            flat(extended_v),
            flat(g),
            flat(beta),
            cu_seqlens,
            scale=scale,
            initial_state=initial,
            output_final_state=True,
            chunk_size=chunk_size,
        )
        assert final is not None  # asked for
        return o.view(pieces, length, *o.shape[2:]), final[last]


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: ContextParallel,
    scale: float,
    document_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the local queries `[B, 2L, H, D]` over the whole sequence's keys and
    values `[B, T, H, D]` (true order); returns `[B, 2L, H, Dv]`. With `document_starts`
    (`[B, T]` bool) a query sees only the keys of its own document.

    Each local piece `p` (true positions `[pL, (p + 1)L)`) attends only the keys up to its own
    end, `[0, (p + 1)L)`, under a lower-right causal mask (`torch.nn.attention.bias.
    causal_lower_right`: query `i` sees keys `j ≤ pL + i`): the causal minimum of scores, and no
    mask tensor on CUDA, where SDPA runs that mask inside flash attention. With documents the
    keys start at the earliest document any of the piece's queries is in, and the mask adds
    "same document" (a materialised `[B, 1, L, keys]` mask: documents need it)."""
    piece = q.shape[1] // 2
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if training and v_dim < qk_dim:  # flash wants one head dim: zero columns, sliced off after
        v = F.pad(v, (0, qk_dim - v_dim))
    outputs = []
    for slot, index in enumerate(cp.local_pieces()):
        queries = q[:, slot * piece : (slot + 1) * piece]
        end = (index + 1) * piece
        if document_starts is None:
            outputs.append(_piece_attention(queries, k[:, :end], v[:, :end], scale))
            continue
        documents = segment_ids(document_starts.to(q.device))  # [B, T]
        begin = _document_begin(document_starts, index * piece)
        query_positions = torch.arange(index * piece, end, device=q.device)
        key_positions = torch.arange(begin, end, device=q.device)
        causal = key_positions[None, :] <= query_positions[:, None]
        same_document = documents[:, index * piece : end, None] == documents[:, None, begin:end]
        mask = (causal & same_document).unsqueeze(1)  # [B, 1, L, end − begin]
        outputs.append(_piece_attention(queries, k[:, begin:end], v[:, begin:end], scale, mask))
    return torch.cat(outputs, dim=1)[..., :v_dim]


def _piece_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`[B, L, H, D]` queries over `[B, S, H, D]` keys, `S ≥ L`, the queries being the last `L`
    positions of the keys' span: lower-right causal, or `mask` (`[B, 1, L, S]`) where given."""
    attn_mask = causal_lower_right(q.shape[1], k.shape[1]) if mask is None else mask
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, scale=scale
    ).transpose(1, 2)


def _document_begin(document_starts: torch.Tensor, position: int) -> int:
    """The earliest true position, over the batch, of the document holding token `position`:
    no query at or after `position` sees a key before it."""
    positions = torch.arange(position + 1, device=document_starts.device)
    starts = torch.where(document_starts[:, : position + 1].to(torch.bool), positions, 0)
    return int(starts.amax(dim=1).amin())  # each row's last start at or before `position`


__all__ = ["ContextParallel", "context_attention"]
