"""GLU activations of K3's MLPs and experts: SiTU-GLU (K3) and SwiGLU (the ablation baseline).

Both take the gate and up projections and return the product fed to the down projection.
SiTU soft-caps both branches, `|β1·tanh(g/β1)·sigmoid(g)| < β1` and `|β2·tanh(u/β2)| < β2`, so
every coordinate of the product stays below β1·β2 (100 in K3) for any input: activation
outliers cannot blow up low-precision expert GEMMs. Computed in fp32 and cast back, as the
Hugging Face reference does (bf16 inputs on the CPU take tanh through sigmoid: within two fp32
units of it, `_tanh_through_sigmoid_`).

`situ_glu` is one autograd function with a closed-form backward: autograd over the plain
formula (`situ_glu_reference`) runs ~10 elementwise passes forward and ~12 backward over the
`[tokens, intermediate]` tensors, and saves six fp32 intermediates. Here the scalar factors
ride inside the products (`torch.addcmul` with a 0-dim input, values 'β1', 'β2'), new tensors
are written in place, and the backward reuses the forward's transcendental results: 7 passes
forward (3 of them tanh/sigmoid), four fp32 tensors saved; the backward writes the gradients
into those saved buffers (8 passes, none transcendental, no new tensor), on CPU in blocks of
rows small enough that its passes stay in the core's cache. Passes that write a
fresh tensor cost the training step about twice an in-place pass (its memory is cold), so the
training callers, whose gate/up are fresh GEMM outputs, let the forward keep tanh(g/β1) and
tanh(u/β2) in those buffers (`overwrite_inputs`): 3 new tensors instead of 5.
"""

import torch

from k3train.kernels.precision import accumulation_dtype, upcast


def situ_glu_reference(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """The definition, differentiated by autograd: `β1·tanh(gate/β1)·sigmoid(gate) ⊙ β2·tanh(up/β2)`
    in fp32 (float64 stays float64), returned in the input dtype."""
    gate32, up32 = upcast(gate), upcast(up)
    activated = beta * torch.tanh(gate32 / beta) * torch.sigmoid(gate32)
    capped_up = linear_beta * torch.tanh(up32 / linear_beta)
    return (activated * capped_up).to(gate.dtype)


class SiTUGLUFunction(torch.autograd.Function):
    """`situ_glu` with its derivatives in closed form. With `a = tanh(g/β1)`, `σ = sigmoid(g)`,
    `b = tanh(u/β2)`, `P = β1·a·σ` (the capped gate), `r` the row scale (1 without one) and `G`
    the output's gradient, the output is `r·P·β2·b` and

        ∂/∂u = r·G·P·(1 − b²)                       = r·(G·P − S·b),  S = G·P·b
        ∂/∂g = r·G·β2·b·K,  K = σ·(1 − a²) + P·(1 − σ) = σ + P·(1 − σ − a/β1)
        ∂/∂r = β2·Σ_j S_j

    (`σ·a² = a·P/β1`), so the backward needs only the saved `a, σ, b, P`. It writes the gradients
    into those four saved buffers (they are dead afterwards): no new full-size tensor, 8 passes
    (12 with a row scale's gradient) where a freshly allocating version took 10 (13) and three
    allocations. Under `retain_graph=True` (gradcheck) it works on copies instead."""

    @staticmethod
    def forward(
        ctx,
        gate: torch.Tensor,
        up: torch.Tensor,
        beta: float,
        linear_beta: float,
        row_scale: torch.Tensor | None = None,
        overwrite_inputs: bool = False,
        recompute_factors: bool = False,
    ) -> torch.Tensor:
        out, factors = _situ_forward(gate, up, beta, linear_beta, row_scale, overwrite_inputs and not recompute_factors)
        ctx.row_scale_dtype = None if row_scale is None else row_scale.dtype
        scale = None if row_scale is None else row_scale.to(factors[0].dtype).unsqueeze(-1)
        # Recompute: keep gate and up (in their own dtype) and rebuild the four fp32 factors in
        # backward with the same operations, so the gradients are the same bits.
        ctx.recompute_factors = recompute_factors
        ctx.save_for_backward(*((gate, up) if recompute_factors else factors), scale)
        ctx.betas = beta, linear_beta
        ctx.input_dtypes = gate.dtype, up.dtype
        return out.to(gate.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        saved = ctx.saved_tensors
        row_scale = saved[-1]
        beta, linear_beta = ctx.betas
        if ctx.recompute_factors:  # fresh buffers: nothing else reads them
            buffers = _situ_forward(saved[0], saved[1], beta, linear_beta, None, False)[1]
        else:
            buffers = saved[:4]  # tanh_gate, sigmoid_gate, tanh_up, capped_gate
            if _graph_is_kept():  # the saved tensors must survive for the next backward
                buffers = tuple(t.clone() for t in buffers)
        return _situ_backward(ctx, grad_out, buffers, row_scale)


def _situ_forward(
    gate: torch.Tensor,
    up: torch.Tensor,
    beta: float,
    linear_beta: float,
    row_scale: torch.Tensor | None,
    overwrite_inputs: bool,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The product (times the row scale) in fp32 and the factors `(a, σ, b, P)` its backward reads."""
    dtype = accumulation_dtype(gate.dtype)
    gate32, up32 = gate.to(dtype), up.to(dtype)
    zero = gate32.new_zeros(())  # 0-dim: `addcmul(zero, x, y, value=c)` is `c·x·y` in one pass
    sigmoid_gate = torch.sigmoid(gate32)
    # A cast made a private copy; otherwise only the caller may say the inputs are scratch.
    # On the CPU, inputs narrower than the computation (bf16/fp16 GEMM outputs) take tanh through
    # sigmoid (`_tanh_through_sigmoid_`): 4 cheap passes instead of tanh's one slow one (on a GPU,
    # where every pass is a memory round trip, tanh's one is cheaper).
    narrow = gate.dtype != dtype and gate.device.type == "cpu"
    gate_scale, up_scale = (2.0 / beta, 2.0 / linear_beta) if narrow else (1.0 / beta, 1.0 / linear_beta)
    tanh_ = _tanh_through_sigmoid_ if narrow else torch.Tensor.tanh_
    tanh_gate = tanh_(
        gate32.mul_(gate_scale) if overwrite_inputs or gate32 is not gate else torch.mul(gate32, gate_scale)
    )
    tanh_up = tanh_(up32.mul_(up_scale) if overwrite_inputs or up32 is not up else torch.mul(up32, up_scale))
    capped_gate = torch.addcmul(zero, tanh_gate, sigmoid_gate, value=beta)
    out = torch.addcmul(zero, capped_gate, tanh_up, value=linear_beta)
    if row_scale is not None:  # in place on the fresh output: a cheap pass
        out.mul_(row_scale.to(dtype).unsqueeze(-1))
    return out, (tanh_gate, sigmoid_gate, tanh_up, capped_gate)


def _tanh_through_sigmoid_(doubled: torch.Tensor) -> torch.Tensor:
    """`tanh(x) = 2·sigmoid(2x) − 1`, in place on `doubled = 2x`. On the CPU torch's fp32 tanh is
    about 5× slower than its sigmoid (2.8 against 0.45 ms per million elements, one AVX-512
    thread); this costs a sigmoid and three multiply/add passes. Its absolute error is at most
    2.4e-7 (two fp32 units at 1: the sigmoid's rounding doubled, plus the subtraction's; 1.8e-7
    observed over [−20, 20]) where tanh's is one: below the rounding a bf16 input already
    carries (`|x|·2⁻⁹`) unless `|x| < 1.2e-4`, where the product's absolute error stays under
    `β1·β2·2.4e-7` (2.4e-5 for K3), far below the bf16 rounding of the down projection's inputs
    of size 1 (2⁻⁹). Used only for bf16/fp16 inputs on the CPU; fp32 and fp64 keep torch's tanh."""
    return doubled.sigmoid_().mul_(2.0).sub_(1.0)


def _situ_backward(ctx, grad_out: torch.Tensor, buffers, row_scale: torch.Tensor | None):
    """`SiTUGLUFunction.backward` from the factors, written into their buffers."""
    beta, linear_beta = ctx.betas
    gate_dtype, up_dtype = ctx.input_dtypes
    need_gate, need_up = ctx.needs_input_grad[:2]
    need_scale = row_scale is not None and ctx.needs_input_grad[4]
    shape, width = buffers[0].shape, buffers[0].shape[-1]
    a, sigma, b, capped = (t.contiguous().view(-1, width) for t in buffers)
    grad = grad_out.to(a.dtype).reshape(-1, width)
    scale = None if row_scale is None else row_scale.reshape(-1, 1)
    rows = a.shape[0]
    sums = a.new_empty(rows) if need_scale else None
    # On CPU, blocks of rows whose ~12 passes stay in the core's cache (the backward is
    # memory-bound, unlike the forward's transcendentals); one block on accelerators.
    block = rows if a.device.type != "cpu" else max(1, CPU_BLOCK_ELEMENTS // width)
    for start in range(0, rows, block):
        part = slice(start, start + block)
        _backward_block(
            a[part],
            sigma[part],
            b[part],
            capped[part],
            grad[part],
            None if scale is None else scale[part],
            None if sums is None else sums[part],
            beta,
            linear_beta,
            need_gate,
            need_up,
        )
    grad_gate = a.view(shape).to(gate_dtype) if need_gate else None
    grad_up = capped.view(shape).to(up_dtype) if need_up else None
    grad_row_scale = None
    if need_scale:
        assert sums is not None and row_scale is not None  # allocated above whenever need_scale
        grad_row_scale = sums.mul_(linear_beta).view(row_scale.shape[:-1]).to(ctx.row_scale_dtype)
    return grad_gate, grad_up, None, None, grad_row_scale, None, None


CPU_BLOCK_ELEMENTS = 1 << 16  # 256 KiB of fp32 per tensor: six such blocks fit a 2 MiB L2


def _backward_block(
    tanh_gate, sigmoid_gate, tanh_up, capped_gate, grad, row_scale, sums, beta, linear_beta, need_gate, need_up
):
    """`SiTUGLUFunction.backward` on rows: the gate's gradient into `tanh_gate`, the up's into
    `capped_gate`, the row scale's `Σ_j G·P·b` (times β2 later) into `sums` when given."""
    zero, one = tanh_gate.new_zeros(()), tanh_gate.new_ones(())
    if need_gate:  # K into a's buffer
        torch.add(sigmoid_gate, tanh_gate, alpha=1.0 / beta, out=tanh_gate)  # σ + a/β1
        torch.addcmul(sigmoid_gate, capped_gate, tanh_gate, value=-1.0, out=tanh_gate)  # σ − P(σ + a/β1)
        tanh_gate.add_(capped_gate)
    if sums is not None:  # S = G·P·b into σ's buffer (σ is dead once K is made)
        products = torch.mul(capped_gate, tanh_up, out=sigmoid_gate).mul_(grad)
        torch.sum(products, -1, out=sums)
    if need_gate:  # r·G·β2·b·K
        tanh_gate.mul_(tanh_up)
        torch.addcmul(zero, tanh_gate, grad, value=linear_beta, out=tanh_gate)
        if row_scale is not None:
            tanh_gate.mul_(row_scale)
    if need_up:  # r·G·P·(1 − b²) into P's buffer (b is dead once the gate's gradient is made)
        if sums is not None:
            capped_gate.mul_(grad)
            torch.addcmul(capped_gate, products, tanh_up, value=-1.0, out=capped_gate)  # G·P − S·b
        else:
            torch.addcmul(one, tanh_up, tanh_up, value=-1.0, out=tanh_up)  # 1 − b²
            capped_gate.mul_(tanh_up).mul_(grad)
        if row_scale is not None:
            capped_gate.mul_(row_scale)


def _graph_is_kept() -> bool:
    """Whether the running backward was asked to keep the graph (`retain_graph=True`)."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else bool(keep_graph())


def situ_glu(
    gate: torch.Tensor,
    up: torch.Tensor,
    beta: float = 4.0,
    linear_beta: float = 25.0,
    row_scale: torch.Tensor | None = None,
    overwrite_inputs: bool = False,
    recompute_factors: bool = False,
) -> torch.Tensor:
    """`β1·tanh(gate/β1)·sigmoid(gate) ⊙ β2·tanh(up/β2)`, in fp32, returned in the input dtype
    (`situ_glu_reference` with a closed-form backward). `row_scale` (`gate.shape[:-1]`, e.g. the
    routing weight of each expert row) multiplies each row of the product in fp32, in place on
    it, with its gradient. `overwrite_inputs=True`: `gate` and `up` are scratch that nothing else
    reads (e.g. fresh GEMM outputs) and the training path keeps two of its saved tensors in
    their buffers instead of allocating new ones; the values of `gate` and `up` are then lost.
    `recompute_factors=True` (`model.recompute_glu`): backward keeps `gate` and `up` in their own
    dtype instead of four fp32 factors and recomputes the factors from them (a forward's worth
    of elementwise passes, bit-identical gradients); `overwrite_inputs` is then ignored.

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
    return SiTUGLUFunction.apply(gate, up, beta, linear_beta, row_scale, overwrite_inputs, recompute_factors)


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    overwrite_inputs: bool = False,
    recompute_factors: bool = False,
) -> torch.Tensor:
    """`silu(gate) ⊙ up` (each row times `row_scale`, in fp32, when given; `overwrite_inputs` and
    `recompute_factors` are accepted for `situ_glu`'s signature and change nothing here)."""
    out = torch.nn.functional.silu(gate) * up
    return out if row_scale is None else _scale_rows(out, row_scale)


def _scale_rows(out: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    return (upcast(out) * row_scale.unsqueeze(-1)).to(out.dtype)
