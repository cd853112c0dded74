"""Dense GLU MLP (layer 0 and the shared experts): SiTU-GLU or SwiGLU."""

from functools import partial

import torch
from torch import nn

from k3train.kernels.situ_glu import situ_glu, swiglu
from k3train.model.config import ModelConfig


def glu_activation(config: ModelConfig):
    """The `(gate, up) -> product` function chosen by `hidden_act`."""
    if config.hidden_act == "situ":
        return partial(situ_glu, beta=config.activation_situ_beta, linear_beta=config.activation_situ_linear_beta)
    return swiglu


class GLUMLP(nn.Module):
    """`down_proj(act(gate_proj x, up_proj x))` (HF names)."""

    def __init__(self, config: ModelConfig, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.activation = glu_activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))
