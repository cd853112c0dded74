"""Kimi Delta Attention checks: chunk_kda's PyTorch path and fla's Triton kernel against the
float64 token-by-token recurrence, and fla against the PyTorch path at training lengths."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from k3train.kernels.kda import chunk_kda, fla_backend, naive_recurrent_kda

from .common import BF16, F32, TOL, Context, Row, compare, guarded, skip, to_cpu64, verdict

KDA_TENSORS = ("q", "k", "v", "g", "beta", "initial_state")


def fla_unavailable_reason(ctx: Context) -> str | None:
    """None when fla's kernel can run here; otherwise why not (fla is only imported on CUDA)."""
    if not ctx.cuda:
        return "needs CUDA (fla's Triton kernels)"
    if fla_backend.load_fla_chunk_kda() is None:
        return "fla-core does not import here: carry its wheel (pip extra 'gpu')"
    return None


def kda_inputs(
    ctx: Context, batch: int, seq: int, heads: int, dim: int, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Inputs as the model makes them: q, k L2-normalised and v in `dtype`; g in K3's bounded gate
    range (−5, 0) and beta in (0, 1), both fp32; an fp32 initial state. All require grad."""
    gen = ctx.generator(seed)
    shape = (batch, seq, heads, dim)
    inputs = {
        "q": F.normalize(ctx.randn(*shape, gen=gen), dim=-1).to(dtype),
        "k": F.normalize(ctx.randn(*shape, gen=gen), dim=-1).to(dtype),
        "v": ctx.randn(*shape, gen=gen, dtype=dtype),
        "g": -5.0 * torch.sigmoid(ctx.randn(*shape, gen=gen) - 1.0),
        "beta": torch.sigmoid(ctx.randn(batch, seq, heads, gen=gen)),
        "initial_state": ctx.randn(batch, heads, dim, dim, gen=gen, scale=0.5),
    }
    return {name: t.requires_grad_() for name, t in inputs.items()}


def kda_cotangents(ctx: Context, inputs: dict[str, torch.Tensor], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random output gradients: `do` in v's dtype, `dS` in fp32."""
    gen = ctx.generator(seed)
    v, state = inputs["v"], inputs["initial_state"]
    return ctx.randn(*v.shape, gen=gen, dtype=v.dtype), ctx.randn(*state.shape, gen=gen)


def kda_forward_backward(
    kernel: Callable, inputs: dict[str, torch.Tensor], cotangents: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Output, final state and the gradients of every input under the given cotangents."""
    o, state = kernel(**inputs, output_final_state=True)
    do, dstate = cotangents
    grads = torch.autograd.grad((o, state), [inputs[n] for n in KDA_TENSORS], (do.to(o.dtype), dstate.to(state.dtype)))
    return {"o": o, "final_state": state, **{f"d{n}": g for n, g in zip(KDA_TENSORS, grads)}}


def kda_reference(inputs: dict[str, torch.Tensor], cotangents: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """The token-by-token recurrence in float64 on the CPU, on exactly the same inputs."""
    inputs64 = dict(zip(inputs, to_cpu64(*inputs.values())))
    do64, dstate64 = to_cpu64(*cotangents)
    return kda_forward_backward(naive_recurrent_kda, inputs64, (do64, dstate64))


def kda_accuracy_row(
    ctx: Context, name: str, kernel: Callable, ref_kernel: Callable, dtype: torch.dtype, tol: float, note: str
) -> Row:
    # T not a multiple of 64; on CUDA the heads of kda_speed, so fla's autotuner sees one shape.
    batch, seq, heads, dim = ctx.pick((1, 150, 16, 128), (1, 100, 2, 32))
    inputs = kda_inputs(ctx, batch, seq, heads, dim, dtype, seed=1)
    cotangents = kda_cotangents(ctx, inputs, seed=2)
    first_ms = ctx.wall_ms(lambda: kda_forward_backward(kernel, inputs, cotangents))
    fast = kda_forward_backward(kernel, inputs, cotangents)
    ref = kda_reference(inputs, cotangents)
    max_abs, rel, worst = compare({key: (fast[key], ref[key]) for key in ref})
    ref_ms = ctx.time_ms(
        lambda: kda_forward_backward(ref_kernel, inputs, cotangents), reps=ctx.pick(5, 1), warmup=ctx.pick(2, 0)
    )
    fast_ms = ctx.time_ms(lambda: kda_forward_backward(kernel, inputs, cotangents))
    return Row(
        name,
        verdict(rel, tol),
        max_abs,
        rel,
        tol,
        ref_ms,
        fast_ms,
        f"B={batch} T={seq} H={heads} K=V={dim} fwd+bwd, h0; worst {worst}; {note}; first call {first_ms:.0f} ms",
    )


def check_kda_chunk(ctx: Context) -> Iterator[Row]:
    """chunk_kda's PyTorch path vs the float64 recurrence: output, final state, all six gradients.
    ref ms: naive_recurrent_kda on the device; fast ms: chunk_kda(backend="torch")."""
    torch_chunk = lambda **kw: chunk_kda(**kw, backend="torch")  # noqa: E731
    for dtype, tol in ((F32, TOL["kda_torch_fp32"]), (BF16, TOL["kda_torch_bf16"])):
        name = f"kda_chunk {'fp32' if dtype == F32 else 'bf16'}"
        yield guarded(
            ctx,
            name,
            lambda: kda_accuracy_row(
                ctx, name, torch_chunk, naive_recurrent_kda, dtype, tol, "ref ms: naive recurrence"
            ),
        )


def check_kda_fla(ctx: Context) -> Iterator[Row]:
    """fla's Triton chunk_kda vs the float64 recurrence (as check_kda_chunk).
    ref ms: chunk_kda(backend="torch"); fast ms: chunk_kda(backend="fla")."""
    reason = fla_unavailable_reason(ctx)
    for dtype, tol in ((F32, TOL["kda_fla_fp32"]), (BF16, TOL["kda_fla_bf16"])):
        name = f"kda_fla {'fp32' if dtype == F32 else 'bf16'}"
        if reason:
            yield skip(name, reason)
            continue
        yield guarded(
            ctx,
            name,
            lambda: kda_accuracy_row(
                ctx,
                name,
                lambda **kw: chunk_kda(**kw, backend="fla"),
                lambda **kw: chunk_kda(**kw, backend="torch"),
                dtype,
                tol,
                "ref ms: torch chunk path",
            ),
        )


def check_kda_speed(ctx: Context) -> Iterator[Row]:
    """fla vs the PyTorch chunk path at training lengths, bf16 q/k/v (fp32 g, beta, state), fwd+bwd.
    The error is fla's output and gradients against the PyTorch path's. Without fla the PyTorch
    path is still timed (a SKIP row with its ref ms).
    ref ms: chunk_kda(backend="torch"); fast ms: chunk_kda(backend="fla")."""
    reason = fla_unavailable_reason(ctx)
    for seq in ctx.pick((4096, 16384), (128,)):
        name = f"kda_speed T={seq}"
        yield guarded(ctx, name, lambda: kda_speed_row(ctx, name, seq, reason))


def kda_speed_row(ctx: Context, name: str, seq: int, fla_missing: str | None) -> Row:
    heads, dim = ctx.pick((16, 128), (2, 32))
    shape = f"B=1 H={heads} K=V={dim} bf16 fwd+bwd"
    inputs = kda_inputs(ctx, 1, seq, heads, dim, BF16, seed=3)
    cotangents = kda_cotangents(ctx, inputs, seed=4)

    def run(backend: str) -> dict[str, torch.Tensor]:
        return kda_forward_backward(lambda **kw: chunk_kda(**kw, backend=backend), inputs, cotangents)

    ref_ms = ctx.time_ms(lambda: run("torch"), reps=ctx.pick(5, 1))
    if fla_missing:
        return skip(name, f"{fla_missing}; {shape}, torch chunk path timed", ref_ms=ref_ms)
    first_ms = ctx.wall_ms(lambda: run("fla"))
    fast_ms = ctx.time_ms(lambda: run("fla"))
    fast, ref = run("fla"), run("torch")
    max_abs, rel, worst = compare({key: (fast[key], ref[key]) for key in ref})
    tol = TOL["kda_fla_vs_torch"]
    return Row(
        name,
        verdict(rel, tol),
        max_abs,
        rel,
        tol,
        ref_ms,
        fast_ms,
        f"{shape}; fla vs torch path, worst {worst}; fla first call {first_ms:.0f} ms",
    )


RAW_TENSORS = ("q", "k", "v", "gate_input", "beta_logits", "A_log", "dt_bias", "initial_state")


def check_kda_fla_raw(ctx: Context) -> Iterator[Row]:
    """fla's kernel on raw inputs (`chunk_kda_from_raw`: q/k normalisation, the gate and β's
    sigmoid fused into fla's launches, the model's CUDA path) against the PyTorch path on the same
    raw inputs (fp32 products), both gates, bf16 q/k/v, fwd+bwd with every gradient (A_log,
    dt_bias included); and, at 16k tokens, fla's opt-in `safe_gate` beside the default path (the
    error that decides whether it may become the default).
    ref ms: the same steps unfused (k3train's normalisation/gate/sigmoid functions, then fla's
    plain kernel); fast ms: fla on raw inputs."""
    from k3train.kernels.kda.raw_inputs import chunk_kda_from_raw, prepare_kda_inputs

    reason = fla_unavailable_reason(ctx)
    # (gate, fla's safe_gate, tokens): the default path for both gates; then the opt-in safe_gate
    # (TF32/bf16x3 products) and the default path at a long sequence, where rounding grows.
    cases = [
        (-5.0, False, None),
        (None, False, None),
        (-5.0, True, ctx.pick(16384, 100)),
        (-5.0, False, ctx.pick(16384, 100)),
    ]
    for lower_bound, safe_gate, seq in cases:
        name = (
            f"kda_fla_raw {'bounded' if lower_bound is not None else 'unbounded'} gate"
            f"{', safe_gate' if safe_gate else ''}{f' T={seq}' if seq else ''}"
        )
        if reason:
            yield skip(name, reason)
            continue
        yield guarded(
            ctx,
            name,
            lambda: kda_raw_row(ctx, name, lower_bound, chunk_kda_from_raw, prepare_kda_inputs, safe_gate, seq),
        )


def kda_raw_row(
    ctx: Context,
    name: str,
    lower_bound: float | None,
    chunk_kda_from_raw: Callable,
    prepare_kda_inputs: Callable,
    safe_gate: bool = False,
    seq: int | None = None,
) -> Row:
    batch, default_seq, heads, dim = ctx.pick((1, 4096, 16, 128), (1, 100, 2, 32))
    seq = seq or default_seq
    gen = ctx.generator(5)
    shape = (batch, seq, heads, dim)
    values = [
        ctx.randn(*shape, gen=gen, dtype=BF16),
        ctx.randn(*shape, gen=gen, dtype=BF16),
        ctx.randn(*shape, gen=gen, dtype=BF16),
        ctx.randn(*shape, gen=gen, dtype=BF16),
        ctx.randn(batch, seq, heads, gen=gen, dtype=BF16),
        ctx.randn(heads, gen=gen, scale=0.5),
        ctx.randn(heads * dim, gen=gen),
        ctx.randn(batch, heads, dim, dim, gen=gen, scale=0.5),
    ]
    inputs = [t.requires_grad_() for t in values]
    do = ctx.randn(batch, seq, heads, dim, gen=gen, dtype=BF16)
    d_state = ctx.randn(batch, heads, dim, dim, gen=gen)

    def run(kernel: Callable) -> dict[str, torch.Tensor]:
        o, state = kernel()
        grads = torch.autograd.grad((o, state), inputs, (do.to(o.dtype), d_state))
        return {"o": o, "final_state": state, **{f"d{n}": g for n, g in zip(RAW_TENSORS, grads)}}

    q, k, v, gate_input, beta_logits, a_log, dt_bias, state = inputs

    def fused():
        return chunk_kda_from_raw(
            q,
            k,
            v,
            gate_input,
            beta_logits,
            a_log,
            dt_bias,
            lower_bound,
            initial_state=state,
            output_final_state=True,
            backend="fla",
            fla_safe_gate=safe_gate,
        )

    def unfused():
        q_hat, k_hat, g, beta = prepare_kda_inputs(q, k, gate_input, beta_logits, a_log, dt_bias, lower_bound)
        return chunk_kda(q_hat, k_hat, v, g, beta, initial_state=state, output_final_state=True, backend="fla")

    def torch_path():
        return chunk_kda_from_raw(
            q,
            k,
            v,
            gate_input,
            beta_logits,
            a_log,
            dt_bias,
            lower_bound,
            initial_state=state,
            output_final_state=True,
            backend="torch",
        )

    first_ms = ctx.wall_ms(lambda: run(fused))
    ref_ms = ctx.time_ms(lambda: run(unfused))
    fast_ms = ctx.time_ms(lambda: run(fused))
    fast, ref = run(fused), run(torch_path)
    max_abs, rel, worst = compare({key: (fast[key], ref[key]) for key in ref})
    tol = TOL["kda_fla_vs_torch"]
    return Row(
        name,
        verdict(rel, tol),
        max_abs,
        rel,
        tol,
        ref_ms,
        fast_ms,
        f"B={batch} T={seq} H={heads} K=V={dim} bf16 fwd+bwd, h0; against the torch path, worst {worst}; "
        f"ref ms: unfused steps + fla's plain kernel; first call {first_ms:.0f} ms",
    )


def fla_module_unavailable_reason(ctx: Context, load: Callable, module: str) -> str | None:
    """As `fla_unavailable_reason`, for one of fla's modules (`load` its guarded loader)."""
    return fla_unavailable_reason(ctx) or (None if load() is not None else f"fla.modules.{module} does not import")


def fla_module_row(
    ctx: Context,
    name: str,
    inputs: dict[str, torch.Tensor],
    grad_output: torch.Tensor,
    forward: Callable[[str], torch.Tensor],
    note: str,
) -> Row:
    """One of fla's fused modules against k3train's PyTorch path: `forward(backend)` with backend
    "auto" (fla on CUDA) and "torch"; output and every input's gradient; times of both."""

    def run(backend: str) -> dict[str, torch.Tensor]:
        output = forward(backend)
        grads = torch.autograd.grad(output, list(inputs.values()), grad_output)
        return {"y": output, **{f"d{key}": grad for key, grad in zip(inputs, grads)}}

    first_ms = ctx.wall_ms(lambda: run("auto"))
    ref_ms, fast_ms = ctx.time_ms(lambda: run("torch")), ctx.time_ms(lambda: run("auto"))
    fast, ref = run("auto"), run("torch")
    max_abs, rel, worst = compare({key: (fast[key], ref[key]) for key in ref})
    tol = TOL["kda_fla_vs_torch"]
    return Row(
        name,
        verdict(rel, tol),
        max_abs,
        rel,
        tol,
        ref_ms,
        fast_ms,
        f"{note} fwd+bwd; against the torch path, worst {worst}; first call {first_ms:.0f} ms",
    )


def check_short_conv_fla(ctx: Context) -> Iterator[Row]:
    """fla's causal convolution with SiLU (the q/k/v short convolutions of a KDA layer on CUDA)
    against `short_conv_silu`'s PyTorch path, bf16 input and fp32 weight as under autocast.
    ref ms: `short_conv_silu(backend="torch")`; fast ms: the default, fla's kernel."""
    from k3train.kernels.short_conv import short_conv_silu

    name = "short_conv_fla"
    reason = fla_module_unavailable_reason(ctx, fla_backend.load_fla_causal_conv1d, "causal_conv1d")
    if reason:
        yield skip(name, reason)
        return

    def row() -> Row:
        batch, seq, channels = ctx.pick((1, 4096, 2048), (2, 100, 64))
        gen = ctx.generator(6)
        inputs = {
            "x": ctx.randn(batch, seq, channels, gen=gen, dtype=BF16).requires_grad_(),
            "weight": ctx.randn(channels, 1, 4, gen=gen, scale=0.5).requires_grad_(),
        }
        grad_output = ctx.randn(batch, seq, channels, gen=gen, dtype=BF16)
        return fla_module_row(
            ctx,
            name,
            inputs,
            grad_output,
            lambda backend: short_conv_silu(inputs["x"], inputs["weight"], backend=backend)[0],
            f"B={batch} T={seq} C={channels} W=4 bf16",
        )

    yield guarded(ctx, name, row)


def check_gated_norm_fla(ctx: Context) -> Iterator[Row]:
    """fla's fused gated RMSNorm (KDA's output norm on CUDA: RMSNorm per head times
    sigmoid(gate)) against `gated_rms_norm`'s PyTorch path, bf16 x and gate, fp32 weight.
    ref ms: `gated_rms_norm(backend="torch")`; fast ms: the default, fla's kernel."""
    from k3train.kernels.norms import gated_rms_norm

    name = "gated_norm_fla"
    reason = fla_module_unavailable_reason(ctx, fla_backend.load_fla_rms_norm_gated, "fused_norm_gate")
    if reason:
        yield skip(name, reason)
        return

    def row() -> Row:
        batch, seq, heads, dim = ctx.pick((1, 4096, 16, 128), (2, 100, 2, 32))
        gen = ctx.generator(7)
        inputs = {
            "x": ctx.randn(batch, seq, heads, dim, gen=gen, dtype=BF16).requires_grad_(),
            "gate": ctx.randn(batch, seq, heads, dim, gen=gen, dtype=BF16).requires_grad_(),
            "weight": (1 + ctx.randn(dim, gen=gen, scale=0.1)).requires_grad_(),
        }
        grad_output = ctx.randn(batch, seq, heads, dim, gen=gen, dtype=BF16)
        return fla_module_row(
            ctx,
            name,
            inputs,
            grad_output,
            lambda backend: gated_rms_norm(inputs["x"], inputs["gate"], inputs["weight"], 1e-5, backend=backend),
            f"B={batch} T={seq} H={heads} D={dim} bf16",
        )

    yield guarded(ctx, name, row)
