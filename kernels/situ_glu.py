"""GLU activations of K3's MLPs and experts: SiTU-GLU (K3) and SwiGLU (the ablation baseline).

Both take the gate and up projections and return the product fed to the down projection.
SiTU soft-caps both branches, `|β1·tanh(g/β1)·sigmoid(g)| < β1` and `|β2·tanh(u/β2)| < β2`, so
every coordinate of the product stays below β1·β2 (100 in K3) for any input: activation
outliers cannot blow up low-precision expert GEMMs. Computed in fp32 and cast back, as the
Hugging Face reference does.
"""

import torch

from k3train.kernels.precision import upcast


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """`β1·tanh(gate/β1)·sigmoid(gate) ⊙ β2·tanh(up/β2)`, in fp32, returned in the input dtype."""
    gate32, up32 = upcast(gate), upcast(up)
    activated = beta * torch.tanh(gate32 / beta) * torch.sigmoid(gate32)
    capped_up = linear_beta * torch.tanh(up32 / linear_beta)
    return (activated * capped_up).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) ⊙ up`."""
    return torch.nn.functional.silu(gate) * up
