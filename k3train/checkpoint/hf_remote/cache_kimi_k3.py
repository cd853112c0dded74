"""The KDA layer's cache for the bundled K3 remote code: transformers' `LinearAttentionLayer`
(three short-convolution histories, q/k/v, and the recurrent state) that can also be cropped, so
assisted generation (prompt lookup, an assistant model) can drop rejected draft tokens.

Registered as the layer type `kimi_delta_attention` (`_layer_type`, as transformers' own models
register theirs; `KimiK3TextConfig.layer_types` names it for KDA layers), so
`DynamicCache(config=…)`, which `generate()` builds, holds one per KDA layer. It is also a
`CacheLayerMixin` that counts the tokens it has seen, so `get_seq_length()` works on a model
without MLA layers too.
While transformers records the past (`activate_past_recording`, assisted generation only), the
layer keeps the state before the last forward and that forward's KDA inputs; `crop(-n)` recomputes
the state over the kept tokens. Needs torch and transformers only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

try:
    from .configuration_kimi_k3 import KDA_CONV_STREAMS, KDA_LAYER_TYPE
    from .kda_kimi_k3 import chunk_kda
except ImportError:  # loaded as top-level modules (tests)
    from configuration_kimi_k3 import KDA_CONV_STREAMS, KDA_LAYER_TYPE  # type: ignore[no-redef]
    from kda_kimi_k3 import chunk_kda  # type: ignore[no-redef]


@dataclass
class KDAPiece:
    """One forward's KDA inputs (`chunk_kda`'s arguments) and the state it started from."""

    initial_state: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float
    chunk_size: int

    def state_after(self, tokens: int) -> torch.Tensor:
        if tokens == 0:
            return self.initial_state
        q, k, v, g, beta = (x[:, :tokens] for x in (self.q, self.k, self.v, self.g, self.beta))
        return chunk_kda(q, k, v, g, beta, self.scale, self.initial_state, self.chunk_size)[1]


class KimiDeltaCacheLayer(LinearAttentionLayer, CacheLayerMixin):
    _layer_type = KDA_LAYER_TYPE
    is_compileable = False  # generate() then keeps the 2-D attention mask the model reads

    def __init__(self, number_of_states: int = KDA_CONV_STREAMS, **kwargs):
        CacheLayerMixin.__init__(self)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        self.last_piece: KDAPiece | None = None
        self.seen_tokens = 0

    def advance(self, tokens: int) -> None:
        """Counts a forward's tokens (padding included, as attention caches count positions)."""
        self.seen_tokens += tokens

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def update(self, key_states, value_states, *args, **kwargs):
        raise TypeError("a KDA layer's cache holds no keys and values: use update_conv_state/update_recurrent_state")

    def reset(self) -> None:
        super().reset()
        self.last_piece, self.seen_tokens = None, 0

    def record(self, piece: KDAPiece) -> None:
        """Keeps `piece` for a later `crop` (only while the past is recorded)."""
        self.last_piece = piece if self.record_past else None

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]  # CacheLayerMixin: a class flag
        return self.record_past

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # the convolution histories
        piece, self.last_piece = self.last_piece, None
        removed = abs(tokens_to_remove)
        self.seen_tokens -= removed
        if removed == 0 or not self.is_recurrent_states_initialized[0]:
            return
        if piece is None or removed > piece.q.shape[1]:
            raise RuntimeError(
                f"cannot crop {removed} tokens from a KDA state: only the last forward's tokens can be removed"
            )
        stored = self.recurrent_states[0]
        assert stored is not None, "an initialised recurrent state is a tensor"
        self.recurrent_states[0] = piece.state_after(piece.q.shape[1] - removed).to(stored.dtype).clone()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.last_piece = None

    def _map_states(self, change) -> None:
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = change(self.conv_states[i])
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = change(self.recurrent_states[i])
        self.last_piece = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_states(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_states(lambda x: x[indices, ...])
