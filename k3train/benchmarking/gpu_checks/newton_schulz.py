"""Newton–Schulz check: Muon's bf16 iteration against the float64 one (update difference and
singular-value band), and the compute dtype it picks on the device."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from k3train.optim.newton_schulz import newton_schulz, ns_compute_dtype

from .common import BF16, F32, F64, TOL, Context, Row, error, guarded, verdict

NS_SINGULAR_BAND = (0.5, 1.5)


def conditioned_matrices(ctx: Context, batch: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """`U diag(s) Vᵀ` with orthonormal U, V and s spread over [0.1, 1]: NS maps every singular
    value of such a matrix into its band in any precision, so the band check tests the
    arithmetic, not the conditioning of a random draw."""
    gen = ctx.generator(seed)
    n = min(rows, cols)
    u = torch.linalg.qr(ctx.randn(batch, rows, n, gen=gen)).Q
    v = torch.linalg.qr(ctx.randn(batch, cols, n, gen=gen)).Q
    s = torch.linspace(1.0, 0.1, n, device=ctx.device)
    return (u * s) @ v.mT


def singular_values(x: torch.Tensor) -> torch.Tensor:
    """Singular values in float64 via the eigenvalues of the smaller Gram matrix."""
    x = x.detach().to(F64)
    gram = x @ x.mT if x.shape[-2] <= x.shape[-1] else x.mT @ x
    return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt()


def check_newton_schulz(ctx: Context) -> Iterator[Row]:
    """newton_schulz with bf16 iterations (its CUDA compute dtype, also forced on the CPU) vs
    the same iteration in float64: relative difference of the update, and every singular value of
    the bf16 result in [0.5, 1.5] (on well-conditioned blocks); on CUDA, ns_compute_dtype must
    pick bf16 (a CPU's pick, by its measured crossover and the call's size, is reported). Timed on random fp32 momenta.
    ref ms: compute_dtype=fp32 on the device; fast ms: bf16."""
    cases = {
        "heads": (ctx.pick((96, 128, 7168), (6, 16, 96)), ctx.pick(8, 3)),  # per-head blocks of a projection
        "experts": (ctx.pick((56, 3072, 3584), (3, 48, 40)), 2),  # one rank's w1 stack
    }
    for label, (shape, check_batch) in cases.items():
        name = f"newton_schulz {label}"
        yield guarded(ctx, name, lambda: newton_schulz_row(ctx, name, shape, check_batch))


def newton_schulz_row(ctx: Context, name: str, shape: tuple[int, int, int], check_batch: int) -> Row:
    batch, rows, cols = shape
    # The default for this case's blocks: bf16 on CUDA (required); on a CPU the size rule's pick.
    default_dtype = ns_compute_dtype(torch.empty(batch, rows, cols, device=ctx.device))
    default_ok = default_dtype == BF16 if ctx.cuda else True
    x = conditioned_matrices(ctx, check_batch, rows, cols, seed=15)
    fast = newton_schulz(x, compute_dtype=BF16)
    ref = newton_schulz(x.to(F64))
    max_abs, rel = error(fast, ref)
    sv_fast, sv_ref = singular_values(fast), singular_values(ref)
    low, high = float(sv_fast.min()), float(sv_fast.max())
    in_band = NS_SINGULAR_BAND[0] <= low and high <= NS_SINGULAR_BAND[1]
    del x, fast, ref
    momentum = ctx.randn(batch, rows, cols, gen=ctx.generator(16))
    reps = ctx.pick(5, 2)  # one fp32 call on the expert stack is ~50 TFLOP: about a second
    ref_ms = ctx.time_ms(lambda: newton_schulz(momentum, compute_dtype=F32), reps=reps, warmup=1)
    fast_ms = ctx.time_ms(lambda: newton_schulz(momentum, compute_dtype=BF16), reps=reps, warmup=1)
    tol = TOL["newton_schulz_bf16"]
    return Row(
        name,
        verdict(rel, tol, in_band, default_ok),
        max_abs,
        rel,
        tol,
        ref_ms,
        fast_ms,
        f"timed {batch}x[{rows},{cols}]; checked {check_batch} of them vs fp64 NS; "
        f"sv bf16 [{low:.3f}, {high:.3f}] fp64 [{float(sv_ref.min()):.3f}, {float(sv_ref.max()):.3f}] "
        f"band {list(NS_SINGULAR_BAND)}; default compute dtype {str(default_dtype)[6:]}",
    )
