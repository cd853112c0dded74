"""RMSNorm computed in fp32 or wider (the Hugging Face Kimi convention), cast back to the input dtype."""

import torch
from torch import nn

from k3train.kernels.precision import upcast


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = upcast(x)
        normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (upcast(self.weight) * normalized).to(x.dtype)
