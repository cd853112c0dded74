"""Routed-expert checks: grouped_mm against its per-group loop (layouts, empty groups, tail
rows), one rank's expert chain timed at K3 sizes, and the expert dispatch that one GPU cannot
check."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from k3train.kernels.grouped_gemm import grouped_mm, grouped_mm_reference
from k3train.kernels.situ_glu import situ_glu

from .common import BF16, F32, F64, TOL, Context, Row, compare, guarded, skip, to_cpu64, verdict


def group_ends(ctx: Context, groups: int, rows: int, seed: int, empty: Sequence[int]) -> torch.Tensor:
    """Skewed random row counts per group (the `empty` groups get none), cumulated: `[groups]`
    int64 on the device, ending at `rows`."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(groups, generator=gen) ** 2 + 0.05
    weights[list(empty)] = 0.0
    picks = torch.multinomial(weights, rows, replacement=True, generator=gen)
    counts = torch.bincount(picks, minlength=groups)
    return counts.cumsum(0).to(ctx.device)


def check_grouped_mm(ctx: Context) -> Iterator[Row]:
    """grouped_mm (torch._grouped_mm on CUDA) vs a float64 per-group loop on the CPU: output and
    both gradients, with empty groups first, in the middle and last; the empty groups' weight
    gradients must be exactly zero. Layouts:
      contiguous    x `[rows, in]`, weights `[G, in, out]`, both contiguous;
      model-layout  weights as the model passes them (`w.transpose(1, 2)` of a `[G, out, in]`
                    stack: column-major) and x sliced from a wider buffer (row stride padded,
                    16-byte aligned);
      tail-rows     model-layout with rows after the last group, as `parallel/expert.py` leaves
                    empty slots: only rows inside the groups are compared; whether the tail of dx
                    comes back finite is noted (its values are unspecified and never used).
    ref ms: grouped_mm_reference (a loop over groups) on the device; fast ms: grouped_mm."""
    for dtype in (F32, BF16):
        for layout in ("contiguous", "model-layout", "tail-rows"):
            name = f"grouped_mm {'fp32' if dtype == F32 else 'bf16'} {layout}"
            yield guarded(ctx, name, lambda: grouped_mm_row(ctx, name, dtype, layout))


def grouped_mm_row(ctx: Context, name: str, dtype: torch.dtype, layout: str) -> Row:
    groups, rows, d_in, d_out = ctx.pick((8, 2048, 512, 384), (6, 96, 32, 24))
    tail = 13 if layout == "tail-rows" else 0
    empty = [0, groups // 2, groups - 1]
    ends = group_ends(ctx, groups, rows - tail, seed=5, empty=empty)
    end = rows - tail
    gen = ctx.generator(6)
    if layout == "contiguous":
        x_leaf = ctx.randn(rows, d_in, gen=gen, dtype=dtype).requires_grad_()
        w_leaf = ctx.randn(groups, d_in, d_out, gen=gen, dtype=dtype, scale=d_in**-0.5).requires_grad_()
        x_of, w_of = (lambda x: x), (lambda w: w)
    else:
        x_leaf = ctx.randn(rows, d_in + 8, gen=gen, dtype=dtype).requires_grad_()
        w_leaf = ctx.randn(groups, d_out, d_in, gen=gen, dtype=dtype, scale=d_in**-0.5).requires_grad_()
        x_of, w_of = (lambda x: x[:, :d_in]), (lambda w: w.transpose(1, 2))
    dout = ctx.randn(rows, d_out, gen=gen, dtype=dtype)
    dout[end:] = 0  # as GroupedExperts.grouped_forward masks the rows of empty slots

    def run(mm: Callable) -> dict[str, torch.Tensor]:
        out = mm(x_of(x_leaf), w_of(w_leaf), ends)
        dx, dw = torch.autograd.grad(out, (x_leaf, w_leaf), dout[: out.shape[0]].to(out.dtype))
        return {"out": out, "dx": dx, "dw": dw}

    fast = run(grouped_mm)
    x64, w64 = to_cpu64(x_leaf, w_leaf)
    out64 = grouped_mm_reference(x_of(x64), w_of(w64), ends.cpu())  # rows up to the last group end
    dx64, dw64 = torch.autograd.grad(out64, (x64, w64), dout[:end].to("cpu", F64))
    max_abs, rel, worst = compare(
        {"out": (fast["out"][:end], out64), "dx": (fast["dx"][:end], dx64[:end]), "dw": (fast["dw"], dw64)}
    )
    empty_zero = bool((fast["dw"][empty] == 0).all())
    ref_ms = ctx.time_ms(lambda: run(grouped_mm_reference))
    fast_ms = ctx.time_ms(lambda: run(grouped_mm))
    path = "torch._grouped_mm" if (ctx.cuda and hasattr(torch, "_grouped_mm")) else "loop (CPU)"
    note = (
        f"G={groups} rows={rows} {d_in}->{d_out} empty={empty} fwd+bwd via {path}; worst {worst}; "
        f"empty-group dw zero: {empty_zero}"
    )
    if tail:
        tail_dx = fast["dx"][end:]
        note += (
            f"; {tail} tail rows, dx there finite: {bool(torch.isfinite(tail_dx).all())}, "
            f"zero: {bool((tail_dx == 0).all())} (not gated)"
        )
    tol = TOL["grouped_mm_fp32" if dtype == F32 else "grouped_mm_bf16"]
    return Row(name, verdict(rel, tol, empty_zero), max_abs, rel, tol, ref_ms, fast_ms, note)


def expert_glu_chain(
    mm: Callable, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """The routed experts as `GroupedExperts.forward_sorted` runs them (weights `[E, out, in]`)."""
    gate = mm(x, w1.transpose(1, 2), ends)
    up = mm(x, w3.transpose(1, 2), ends)
    return mm(situ_glu(gate, up), w2.transpose(1, 2), ends)


def check_grouped_mm_speed(ctx: Context) -> Iterator[Row]:
    """One rank's routed experts, bf16, fwd+bwd of gate/up/down grouped GEMMs with SiTU-GLU
    between (K3 per rank: 56 local experts, latent 3584, inner 3072, 8192 slots, skewed routing
    with two idle experts). The error is grouped_mm's output and dx against the loop's.
    ref ms: the chain on grouped_mm_reference; fast ms: on grouped_mm."""
    experts, latent, inner, slots = ctx.pick((56, 3584, 3072, 8192), (4, 32, 24, 128))
    ends = group_ends(ctx, experts, slots, seed=7, empty=(1, experts - 1))
    gen = ctx.generator(8)
    x = ctx.randn(slots, latent, gen=gen, dtype=BF16).requires_grad_()
    w1 = ctx.randn(experts, inner, latent, gen=gen, dtype=BF16, scale=latent**-0.5).requires_grad_()
    w3 = ctx.randn(experts, inner, latent, gen=gen, dtype=BF16, scale=latent**-0.5).requires_grad_()
    w2 = ctx.randn(experts, latent, inner, gen=gen, dtype=BF16, scale=inner**-0.5).requires_grad_()
    dout = ctx.randn(slots, latent, gen=gen, dtype=BF16)

    def run(mm: Callable) -> dict[str, torch.Tensor]:
        out = expert_glu_chain(mm, x, w1, w3, w2, ends)
        dx, *_ = torch.autograd.grad(out, (x, w1, w3, w2), dout)
        return {"out": out, "dx": dx}

    first_ms = ctx.wall_ms(lambda: run(grouped_mm))
    fast, ref = run(grouped_mm), run(grouped_mm_reference)
    max_abs, rel, worst = compare({key: (fast[key], ref[key]) for key in ref})
    ref_ms = ctx.time_ms(lambda: run(grouped_mm_reference), reps=ctx.pick(5, 2))
    fast_ms = ctx.time_ms(lambda: run(grouped_mm))
    flop = 18 * slots * latent * inner  # 3 GEMMs x (forward, dx, dw) x 2 flop per multiply-add
    tol = TOL["grouped_mm_speed"]
    yield Row(
        "grouped_mm_speed",
        verdict(rel, tol),
        max_abs,
        rel,
        tol,
        ref_ms,
        fast_ms,
        f"E={experts} l={latent} I={inner} slots={slots} bf16 fwd+bwd; worst {worst} (vs loop); "
        f"{flop / fast_ms / 1e9:.1f} TFLOP/s grouped, {flop / ref_ms / 1e9:.1f} loop; "
        f"first call {first_ms:.0f} ms",
    )


def check_expert_dispatch(ctx: Context) -> Iterator[Row]:
    """ExpertParallel's all-to-all dispatch needs several ranks: nothing meaningful on one GPU."""
    yield skip(
        "expert_dispatch",
        "needs >= 2 GPUs (all-to-all over an EP group); covered on CPU/gloo by "
        "tests/distributed/test_expert_parallel.py; its local expert GEMMs are grouped_mm_speed",
    )
