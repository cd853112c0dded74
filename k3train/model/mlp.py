"""Dense GLU MLP (layer 0 and the shared experts): SiTU-GLU or SwiGLU."""

from functools import partial

import torch
from torch import nn

from k3train.kernels.situ_glu import situ_glu, swiglu
from k3train.model.config import ModelConfig
from k3train.parallel.tensor import TensorParallel


def glu_activation(config: ModelConfig):
    """The `(gate, up) -> product` function chosen by `hidden_act`."""
    if config.hidden_act == "situ":
        return partial(
            situ_glu,
            beta=config.activation_situ_beta,
            linear_beta=config.activation_situ_linear_beta,
            recompute_factors=config.recompute_glu,
        )
    return swiglu


class GLUMLP(nn.Module):
    """`down_proj(act(gate_proj x, up_proj x))` (HF names); the intermediate width is split over TP."""

    def __init__(
        self,
        config: ModelConfig,
        hidden_size: int,
        intermediate_size: int,
        tensor_parallel: TensorParallel | None = None,
    ):
        super().__init__()
        self.tp = tp = tensor_parallel or TensorParallel.single()
        self.gate_proj = tp.shard_linear(tp.linear(hidden_size, intermediate_size), partition_dim=0)
        self.up_proj = tp.shard_linear(tp.linear(hidden_size, intermediate_size), partition_dim=0)
        self.down_proj = tp.shard_linear(tp.linear(intermediate_size, hidden_size), partition_dim=1)
        self.activation = glu_activation(config)
        # A sublayer recomputed in backward keeps its leave unfused (TensorParallel.leave_projection).
        self.fuse_leave = config.recompute != "sublayer"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (gate, up) = self.tp.enter_projections(x, [self.gate_proj, self.up_proj])
        # the projections' fresh outputs are scratch (a linear's backward keeps its input, not its
        # output): SiTU-GLU keeps two of its saved tensors in their buffers
        hidden = self.activation(gate, up, overwrite_inputs=True)
        return self.tp.leave_projection(hidden, self.down_proj, self.fuse_leave)
