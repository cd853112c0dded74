"""The Attention Residuals mix (depth attention over earlier block representations).

For sources `v_0..v_m` (each `[..., d]`), a learned query `w` and the keys' RMSNorm gain `γ`:
`k_i = RMSNorm(v_i)`, `s_i = (γ ⊙ w)ᵀ k_i`, `α = softmax_i(s)`, output `Σ α_i v_i` over the raw
values. Scores, softmax and the weighted sum run in fp32 whatever the input dtype (the Hugging
Face reference does the same), and the result is cast back to the sources' dtype.
"""

from typing import Sequence

import torch

from k3train.kernels.precision import upcast, without_autocast


def attn_res_mix(
    sources: Sequence[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """Mix `sources` (all of one shape `[..., d]`) with depth attention; returns `[..., d]`."""
    with without_autocast(sources[0].device):  # bf16 autocast must not downcast the mix
        values = torch.stack([upcast(source) for source in sources], dim=-2)  # [..., sources, d]
        keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
        score_weight = upcast(norm_weight) * upcast(query)
        probabilities = (keys * score_weight).sum(-1).softmax(-1)  # [..., sources]
        mixed = (probabilities.unsqueeze(-2) @ values).squeeze(-2)
    return mixed.to(sources[0].dtype)
