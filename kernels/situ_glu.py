"""GLU activations of K3's MLPs and experts: SiTU-GLU (K3) and SwiGLU (the ablation baseline).

Both take the gate and up projections and return the product fed to the down projection.
SiTU soft-caps both branches, `|β1·tanh(g/β1)·sigmoid(g)| < β1` and `|β2·tanh(u/β2)| < β2`, so
every coordinate of the product stays below β1·β2 (100 in K3) for any input: activation
outliers cannot blow up low-precision expert GEMMs. Computed in fp32 and cast back, as the
Hugging Face reference does.

`situ_glu` is one autograd function with a closed-form backward: autograd over the plain
formula (`situ_glu_reference`) runs ~10 elementwise passes forward and ~12 backward over the
`[tokens, intermediate]` tensors, and saves six fp32 intermediates. Here the scalar factors
ride inside the products (`torch.addcmul` with a 0-dim input, values 'β1', 'β2'), new tensors
are written in place, and the backward reuses the forward's transcendental results: 7 passes
forward (3 of them tanh/sigmoid), 8 backward (none transcendental), four fp32 tensors saved.
"""

import torch

from k3train.kernels.precision import accumulation_dtype, upcast


def situ_glu_reference(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0,
                       linear_beta: float = 25.0) -> torch.Tensor:
    """The definition, differentiated by autograd: `β1·tanh(gate/β1)·sigmoid(gate) ⊙ β2·tanh(up/β2)`
    in fp32 (float64 stays float64), returned in the input dtype."""
    gate32, up32 = upcast(gate), upcast(up)
    activated = beta * torch.tanh(gate32 / beta) * torch.sigmoid(gate32)
    capped_up = linear_beta * torch.tanh(up32 / linear_beta)
    return (activated * capped_up).to(gate.dtype)


class SiTUGLUFunction(torch.autograd.Function):
    """`situ_glu` with its derivatives in closed form. With `a = tanh(g/β1)`, `σ = sigmoid(g)`,
    `b = tanh(u/β2)` and `P = β1·a·σ` (the capped gate), the output is `P·β2·b` and

        ∂/∂u = P·(1 − b²)
        ∂/∂g = β2·b·[σ·(1 − a²) + P·(1 − σ)] = β2·b·[σ + P·(1 − σ − a/β1)]

    (`σ·a² = a·P/β1`), so the backward needs only the saved `a, σ, b, P`."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float,
                row_scale: torch.Tensor | None = None) -> torch.Tensor:
        dtype = accumulation_dtype(gate.dtype)
        gate32, up32 = gate.to(dtype), up.to(dtype)
        zero = gate32.new_zeros(())  # 0-dim: `addcmul(zero, x, y, value=c)` is `c·x·y` in one pass
        tanh_gate = torch.mul(gate32, 1.0 / beta).tanh_()
        sigmoid_gate = torch.sigmoid(gate32)
        tanh_up = torch.mul(up32, 1.0 / linear_beta).tanh_()
        capped_gate = torch.addcmul(zero, tanh_gate, sigmoid_gate, value=beta)
        out = torch.addcmul(zero, capped_gate, tanh_up, value=linear_beta)
        ctx.row_scale_dtype = None if row_scale is None else row_scale.dtype
        if row_scale is not None:  # in place on the fresh output: a cheap pass
            row_scale = row_scale.to(dtype).unsqueeze(-1)
            out.mul_(row_scale)
        ctx.save_for_backward(tanh_gate, sigmoid_gate, tanh_up, capped_gate, row_scale)
        ctx.betas = beta, linear_beta
        ctx.input_dtypes = gate.dtype, up.dtype
        return out.to(gate.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        tanh_gate, sigmoid_gate, tanh_up, capped_gate, row_scale = ctx.saved_tensors
        beta, linear_beta = ctx.betas
        gate_dtype, up_dtype = ctx.input_dtypes
        grad = grad_out.to(tanh_gate.dtype)
        zero, one = tanh_gate.new_zeros(()), tanh_gate.new_ones(())
        grad_gate = grad_up = grad_row_scale = None
        if row_scale is not None and ctx.needs_input_grad[4]:  # Σ_j grad_j · (P·β2·b)_j
            unscaled = torch.addcmul(zero, capped_gate, tanh_up, value=linear_beta)
            grad_row_scale = unscaled.mul_(grad).sum(-1).to(ctx.row_scale_dtype)
        if ctx.needs_input_grad[1]:
            grad_up = torch.addcmul(one, tanh_up, tanh_up, value=-1.0)  # 1 − b²
            grad_up.mul_(capped_gate).mul_(grad)
            if row_scale is not None:
                grad_up.mul_(row_scale)
            grad_up = grad_up.to(up_dtype)
        if ctx.needs_input_grad[0]:
            grad_gate = torch.add(sigmoid_gate, tanh_gate, alpha=1.0 / beta)  # σ + a/β1
            torch.addcmul(sigmoid_gate, capped_gate, grad_gate, value=-1.0, out=grad_gate)  # σ − P(σ + a/β1)
            grad_gate.add_(capped_gate)
            grad_gate.mul_(tanh_up)
            torch.addcmul(zero, grad_gate, grad, value=linear_beta, out=grad_gate)
            if row_scale is not None:
                grad_gate.mul_(row_scale)
            grad_gate = grad_gate.to(gate_dtype)
        return grad_gate, grad_up, None, None, grad_row_scale


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0,
             row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`β1·tanh(gate/β1)·sigmoid(gate) ⊙ β2·tanh(up/β2)`, in fp32, returned in the input dtype
    (`situ_glu_reference` with a closed-form backward). `row_scale` (`gate.shape[:-1]`, e.g. the
    routing weight of each expert row) multiplies each row of the product in fp32, in place on
    it, with its gradient.

    The plain formula runs instead (1) under `torch.compile`: inductor fuses it, and its
    derivative, into single kernels, which the pass-counting above cannot beat; (2) without
    autograd (evaluation, scoring, generation): the gain is in the backward, and the formula's
    operation order is the exported remote code's, whose fp32 logits stay bit-equal to
    `tools/score.py`'s (docs/hf_conversion.md)."""
    inputs = (gate, up) if row_scale is None else (gate, up, row_scale)
    records = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    if torch.compiler.is_compiling() or not records:
        out = situ_glu_reference(gate, up, beta, linear_beta)
        return out if row_scale is None else _scale_rows(out, row_scale)
    return SiTUGLUFunction.apply(gate, up, beta, linear_beta, row_scale)


def swiglu(gate: torch.Tensor, up: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(gate) ⊙ up` (each row times `row_scale`, in fp32, when given)."""
    out = torch.nn.functional.silu(gate) * up
    return out if row_scale is None else _scale_rows(out, row_scale)


def _scale_rows(out: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    return (upcast(out) * row_scale.unsqueeze(-1)).to(out.dtype)
