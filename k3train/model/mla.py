"""Gated Multi-head Latent Attention with NoPE (docs/design.md §1.2).

Low-rank query and key/value compressions as in DeepSeek's MLA, with the 'rope' slice of the
head kept for checkpoint compatibility but never rotated: K3's KDA layers carry position, so
the softmax layers are position-free. A per-head sigmoid gate multiplies the attention output
before `o_proj`; there is no norm around it (the released checkpoints carry none).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import flop_counter

from k3train.contracts.param_roles import linear_weight, mark_head_blocks
from k3train.kernels.segments import length_buckets, pack_segments, segment_offsets, unpack_buckets
from k3train.model.config import ModelConfig
from k3train.model.norm import RMSNorm
from k3train.parallel.context import ContextParallel, context_attention
from k3train.parallel.tensor import TensorParallel

LATENT_NORM_EPS = 1e-6  # q_a/kv_a layernorms use 1e-6, not rms_norm_eps
DOCUMENT_LENGTH_UNIT = 64  # packed documents attend in groups padded to whole multiples of this


def causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention of `[batch, seq, heads, dim]` tensors (v's dim may differ from q/k's)."""
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    ).transpose(1, 2)


def causal_attention(
    q: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """`causal_attention_reference(q, cat(k_nope, k_rope), v)`; in training, with v zero-padded
    to q/k's head dim.

    SDPA's fused (flash) kernels want one head dim for q, k and v; MLA's v (64) is narrower than
    q/k (96), which sends the call to the math path (a materialised score matrix and its mask
    passes, slower on CPU too: benchmarks/fused_paths.py measures it).
    Zero columns of v only add zero columns to the output, sliced off after, so the result is
    the same attention (vLLM's MLA prefill pads v the same way). Without autograd (evaluation,
    scoring, generation) the unpadded call runs: the exported remote code makes that same call,
    so its fp32 logits stay bit-equal to `tools/score.py`'s (docs/hf_conversion.md).
    """
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_nope, k_rope, v))
    k = torch.cat([k_nope, k_rope], dim=-1)
    if v_dim >= qk_dim or not training:
        return causal_attention_reference(q, k, v, scale)
    v_padded = F.pad(v, (0, qk_dim - v_dim))  # separate from k's cat: no cat of their gradients
    return causal_attention_reference(q, k, v_padded, scale)[..., :v_dim]


def document_causal_attention(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    document_starts: torch.Tensor,
) -> torch.Tensor:
    """`causal_attention` with every query restricted to its own document's earlier keys
    (block-diagonal causal; `document_starts [batch, seq]` bool, True where a document begins).

    The documents, grouped by length in units of `DOCUMENT_LENGTH_UNIT` tokens, are packed into
    one zero-padded batch per group (`kernels.segments`) and each group runs the plain causal
    call: no `[T, T]` mask exists, the fused kernels stay reachable, and the work is about
    `Σ D²` over the documents rather than `T²` per row."""
    batch, seq = q.shape[:2]
    cu_seqlens = segment_offsets(document_starts.to(q.device))
    buckets = length_buckets(cu_seqlens, DOCUMENT_LENGTH_UNIT)
    flat = [t.reshape(batch * seq, *t.shape[2:]) for t in (q, k_nope, k_rope, v)]
    attended = []
    for segments in buckets:
        q_b, k_nope_b, k_rope_b, v_b = (pack_segments(t, cu_seqlens, segments=segments) for t in flat)
        attended.append(causal_attention(q_b, k_nope_b, k_rope_b, v_b, scale))
    return unpack_buckets(attended, cu_seqlens, buckets).view(batch, seq, *attended[0].shape[2:])


def _cpu_flash_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """CPU flash attention forward, counted as the math path counts the same call (k3train/model/
    flops.py's `attention="full"`): `QKᵀ` and `AV` over the whole `T×T` square, `v` at the width
    it was given (padded columns included: they are multiplied)."""
    batch, heads, queries, qk_dim = query_shape
    return 2 * batch * heads * queries * key_shape[-2] * (qk_dim + value_shape[-1])


def _cpu_flash_attention_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    """Twice the forward (the input gradients of both products), as for the math path; the
    kernel's recomputation of the scores is not counted (model FLOPs exclude recomputation)."""
    return 2 * _cpu_flash_attention_flop(query_shape, key_shape, value_shape)


# torch's FlopCounterMode knows the CUDA fused attention ops but not the CPU flash kernel that
# the padded path reaches; without this the MLA attention would count as zero FLOPs on CPU.
for _op, _formula in (
    (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, _cpu_flash_attention_flop),
    (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward, _cpu_flash_attention_backward_flop),
):
    if _op not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(_op)(_formula)


class GatedMLA(nn.Module):
    """Heads split over tensor-parallel ranks; the low-rank `q_a`/`kv_a` stages are replicated."""

    def __init__(self, config: ModelConfig, tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.tp = tensor_parallel or TensorParallel.single()
        self.num_heads = config.num_attention_heads // self.tp.size  # heads on this rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.context_parallel: ContextParallel | None = None  # set by K3ModelChunk when cp > 1
        # A sublayer recomputed in backward keeps its leave unfused (TensorParallel.leave_projection).
        self.fuse_leave = config.recompute != "sublayer"
        heads, hidden, qk_head_dim = config.num_attention_heads, config.hidden_size, config.qk_head_dim

        if config.q_lora_rank is None:
            self.q_proj = self.tp.linear(hidden, heads * qk_head_dim)
            mark_head_blocks(linear_weight(self.q_proj), 0, heads)
        else:
            self.q_a_proj = self.tp.linear(hidden, config.q_lora_rank)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = self.tp.linear(config.q_lora_rank, heads * qk_head_dim)
            mark_head_blocks(linear_weight(self.q_b_proj), 0, heads)
        self.kv_a_proj_with_mqa = self.tp.linear(hidden, config.kv_lora_rank + config.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = self.tp.linear(config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim))
        mark_head_blocks(linear_weight(self.kv_b_proj), 0, heads)
        self.use_output_gate = config.mla_use_output_gate
        if self.use_output_gate:
            self.g_proj = self.tp.linear(hidden, heads * config.v_head_dim)
            mark_head_blocks(linear_weight(self.g_proj), 0, heads)
        self.o_proj = self.tp.linear(heads * config.v_head_dim, hidden)
        mark_head_blocks(linear_weight(self.o_proj), 1, heads)
        self.softmax_scale = qk_head_dim**-0.5
        self._shard_heads()

    def _shard_heads(self) -> None:
        tp = self.tp
        for name in ("q_proj", "q_b_proj", "kv_b_proj", "g_proj"):
            if hasattr(self, name):
                setattr(self, name, tp.shard_linear(getattr(self, name), partition_dim=0))
        self.o_proj = tp.shard_linear(self.o_proj, partition_dim=1)
        replicated = [linear_weight(self.kv_a_proj_with_mqa), self.kv_a_layernorm.weight]
        if hasattr(self, "q_a_proj"):
            replicated += [linear_weight(self.q_a_proj), self.q_a_layernorm.weight]
        tp.mark_partial_grad(replicated)  # each rank back-propagates only its own heads into them

    def forward(self, x: torch.Tensor, document_starts: torch.Tensor | None = None) -> torch.Tensor:
        """`document_starts` (`[batch, seq]` bool over the whole sequence, or None): each query
        attends only the keys of its own document."""
        # The region's entry and every projection of its input (overlapped with the entry's
        # collectives when the layout asks for it: `parallel.tp_overlap_chunks`).
        query_proj = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        projections = [query_proj, self.kv_a_proj_with_mqa] + ([self.g_proj] if self.use_output_gate else [])
        _, (q, latent, *gate) = self.tp.enter_projections(x, projections)
        batch, seq, _ = q.shape
        heads = self.num_heads
        if not hasattr(self, "q_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(batch, seq, heads, -1)

        cp = self.context_parallel if self.context_parallel is not None and self.context_parallel.size > 1 else None
        if cp is not None:  # the whole sequence's compressed KV, in true order (parallel/context.py)
            latent = cp.gather_sequence(latent)
        compressed_kv, k_rope = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv)).view(batch, latent.shape[1], heads, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        # NoPE: the shared 'rope' key slice is broadcast to every head unrotated.
        k_rope = k_rope.unsqueeze(2).expand(-1, -1, heads, -1)

        if cp is not None:
            k = torch.cat([k_nope, k_rope], dim=-1)
            attended = context_attention(q, k, v, cp, self.softmax_scale, document_starts)
        elif document_starts is not None:
            attended = document_causal_attention(q, k_nope, k_rope, v, self.softmax_scale, document_starts)
        else:
            attended = causal_attention(q, k_nope, k_rope, v, self.softmax_scale)  # [batch, seq, heads, v_head_dim]
        if self.use_output_gate:
            attended = attended * torch.sigmoid(gate[0]).view(batch, seq, heads, -1)
        return self.tp.leave_projection(
            attended.reshape(batch, seq, heads * self.v_head_dim), self.o_proj, self.fuse_leave
        )
