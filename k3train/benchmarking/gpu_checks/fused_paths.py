"""Element-wise and fused fast paths: the AttnRes mix and SiTU-GLU in bf16, and each training
fast path with a written-out backward (fused_paths) in fp32, all against float64 references."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from k3train.kernels.attn_res import attn_res_mix, attn_res_mix_reference, attn_res_mix_rmsnorm
from k3train.kernels.kda import chunk_kda, kda_gate, kda_gate_reference
from k3train.kernels.kda.chunk import chunk_kda_autograd_reference
from k3train.kernels.norms import gated_rms_norm, gated_rms_norm_reference, l2_normalize, l2_normalize_reference
from k3train.kernels.short_conv import short_conv_silu, short_conv_silu_reference
from k3train.kernels.situ_glu import situ_glu, situ_glu_reference
from k3train.model.mla import causal_attention, causal_attention_reference

from .common import BF16, F32, F64, TOL, Context, Row, compare, guarded, to_cpu64, verdict


def check_attn_res(ctx: Context) -> Iterator[Row]:
    """attn_res_mix with bf16 sources (fp32 norm gain and query, as in the model) vs float64 on
    the CPU, output and all gradients. Timed at a larger shape.
    ref ms: the same op on fp32 sources on the device; fast ms: on bf16 sources."""
    n_sources, eps = 9, 1e-5

    def inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[list, torch.Tensor, torch.Tensor]:
        """Sources of growing scale in `dtype`; fp32 norm gain near 1 and a query giving O(1) scores."""
        gen = ctx.generator(seed)
        d = shape[-1]
        sources = [
            ctx.randn(*shape, gen=gen, dtype=dtype, scale=1.0 + i / 2).requires_grad_() for i in range(n_sources)
        ]
        norm_weight = (1.0 + ctx.randn(d, gen=gen, scale=0.1)).requires_grad_()
        query = ctx.randn(d, gen=gen, scale=d**-0.5).requires_grad_()
        return sources, norm_weight, query

    def run(sources, norm_weight, query, dout) -> dict[str, torch.Tensor]:
        out = attn_res_mix(sources, norm_weight, query, eps)
        grads = torch.autograd.grad(out, [*sources, norm_weight, query], dout.to(out.dtype))
        return {"out": out, "dsources": torch.stack(grads[:n_sources]), "dnorm": grads[-2], "dquery": grads[-1]}

    shape = ctx.pick((1, 512, 7168), (2, 16, 64))
    sources, norm_weight, query = inputs(shape, BF16, seed=9)
    dout = ctx.randn(*shape, gen=ctx.generator(10), dtype=BF16)
    fast = run(sources, norm_weight, query, dout)
    *sources64, norm_weight64, query64 = to_cpu64(*sources, norm_weight, query)
    ref = run(sources64, norm_weight64, query64, dout.to("cpu", F64))
    max_abs, rel, worst = compare({key: (fast[key], ref[key]) for key in ref})

    time_shape = ctx.pick((1, 4096, 7168), shape)
    timed = {
        dtype: (*inputs(time_shape, dtype, seed=11), ctx.randn(*time_shape, gen=ctx.generator(12), dtype=dtype))
        for dtype in (F32, BF16)
    }
    ref_ms = ctx.time_ms(lambda: run(*timed[F32]))
    fast_ms = ctx.time_ms(lambda: run(*timed[BF16]))
    tol = TOL["attn_res_bf16"]
    yield Row(
        "attn_res bf16",
        verdict(rel, tol),
        max_abs,
        rel,
        tol,
        ref_ms,
        fast_ms,
        f"{n_sources} sources {list(shape)} vs fp64 CPU, fwd+bwd; worst {worst}; "
        f"timed at {list(time_shape)}, ref ms: fp32 sources",
    )


def check_situ_glu(ctx: Context) -> Iterator[Row]:
    """situ_glu on bf16 gate/up (with outliers that saturate both soft caps) vs float64 on the
    CPU, output and both gradients. ref ms: fp32 inputs on the device; fast ms: bf16 inputs."""
    rows, inner = ctx.pick((8192, 3072), (64, 48))

    def inputs(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = ctx.generator(seed)
        gate = ctx.randn(rows, inner, gen=gen, scale=3.0)
        up = ctx.randn(rows, inner, gen=gen, scale=3.0)
        gate[::97] *= 30.0  # outlier rows: tanh and sigmoid saturate
        up[::89] *= 30.0
        dout = ctx.randn(rows, inner, gen=gen, dtype=dtype)
        return gate.to(dtype).requires_grad_(), up.to(dtype).requires_grad_(), dout

    def run(gate, up, dout) -> dict[str, torch.Tensor]:
        out = situ_glu(gate, up)
        dgate, dup = torch.autograd.grad(out, (gate, up), dout.to(out.dtype))
        return {"out": out, "dgate": dgate, "dup": dup}

    gate, up, dout = inputs(BF16, seed=13)
    fast = run(gate, up, dout)
    gate64, up64 = to_cpu64(gate, up)
    ref = run(gate64, up64, dout.to("cpu", F64))
    max_abs, rel, worst = compare({key: (fast[key], ref[key]) for key in ref})
    timed = {dtype: inputs(dtype, seed=14) for dtype in (F32, BF16)}
    ref_ms = ctx.time_ms(lambda: run(*timed[F32]))
    fast_ms = ctx.time_ms(lambda: run(*timed[BF16]))
    tol = TOL["situ_glu_bf16"]
    yield Row(
        "situ_glu bf16",
        verdict(rel, tol),
        max_abs,
        rel,
        tol,
        ref_ms,
        fast_ms,
        f"[{rows}, {inner}] vs fp64 CPU, fwd+bwd; worst {worst}; ref ms: fp32 inputs",
    )


def fused_path_cases(ctx: Context) -> dict[str, tuple[Callable, Callable, Callable[[int], list[torch.Tensor]]]]:
    """name -> (fast, reference, inputs(seed)): each training fast path with a written-out
    backward and the plain formula it replaces (the pairs the unit tests hold together in float64)."""
    batch, seq, heads, dim = ctx.pick((2, 4096, 16, 128), (2, 40, 2, 16))
    width, hidden = heads * dim, ctx.pick(7168, 64)

    def normal(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return ctx.randn(*shape, gen=ctx.generator(seed), scale=scale).requires_grad_()

    def kda_inputs(seed: int) -> list[torch.Tensor]:
        q, k = (
            F.normalize(normal(seed + i, batch, seq, heads, dim), dim=-1).detach().requires_grad_() for i in range(2)
        )
        v = normal(seed + 2, batch, seq, heads, dim)
        g = (
            -5 * torch.rand(batch, seq, heads, dim, generator=ctx.generator(seed + 3), device=ctx.device)
        ).requires_grad_()
        beta = torch.rand(batch, seq, heads, generator=ctx.generator(seed + 4), device=ctx.device).requires_grad_()
        return [q, k, v, g, beta, normal(seed + 5, batch, heads, dim, dim, scale=0.1)]

    def mix_inputs(seed: int) -> list[torch.Tensor]:
        sources = [normal(seed + i, batch, seq, hidden, scale=1 + i / 2) for i in range(5)]
        return [
            *sources,
            (1 + normal(seed + 9, hidden, scale=0.1)).detach().requires_grad_(),
            normal(seed + 10, hidden, scale=hidden**-0.5),
            (1 + normal(seed + 11, hidden, scale=0.1)).detach().requires_grad_(),
        ]

    def mix_reference(*tensors):
        *sources, norm_weight, query, out_weight = tensors
        mixed = attn_res_mix_reference(sources, norm_weight, query, 1e-6).float()
        return (mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + 1e-6) * out_weight).to(sources[0].dtype)

    return {
        "short_conv_silu": (
            lambda x, w, tail: short_conv_silu(x, w, tail)[0],
            lambda x, w, tail: short_conv_silu_reference(x, w, tail)[0],
            lambda seed: [
                normal(seed, batch, seq, width),
                normal(seed + 1, width, 1, 4, scale=0.5),
                normal(seed + 2, batch, width, 3),
            ],
        ),
        "l2_normalize": (l2_normalize, l2_normalize_reference, lambda seed: [normal(seed, batch, seq, heads, dim)]),
        "gated_rms_norm": (
            lambda x, gate, w: gated_rms_norm(x, gate, w, 1e-5),
            lambda x, gate, w: gated_rms_norm_reference(x, gate, w, 1e-5),
            lambda seed: [
                normal(seed, batch, seq, heads, dim),
                normal(seed + 1, batch, seq, heads, dim),
                (1 + normal(seed + 2, dim, scale=0.1)).detach().requires_grad_(),
            ],
        ),
        "kda_gate": (
            kda_gate,
            kda_gate_reference,
            lambda seed: [
                normal(seed, batch, seq, heads, dim),
                normal(seed + 1, heads, scale=0.5),
                normal(seed + 2, heads * dim, scale=0.5),
            ],
        ),
        "situ_glu_row_scale": (
            lambda gate, up, scale: situ_glu(gate, up, row_scale=scale),
            lambda gate, up, scale: situ_glu_reference(gate, up) * scale.unsqueeze(-1),
            lambda seed: [
                normal(seed, batch * seq, 4 * dim, scale=3.0),
                normal(seed + 1, batch * seq, 4 * dim, scale=3.0),
                torch.rand(batch * seq, generator=ctx.generator(seed + 2), device=ctx.device).requires_grad_(),
            ],
        ),
        "mla_padded_v_attention": (
            lambda q, k_nope, k_rope, v: causal_attention(q, k_nope, k_rope, v, 96**-0.5),
            lambda q, k_nope, k_rope, v: causal_attention_reference(
                q, torch.cat([k_nope, k_rope], dim=-1), v, 96**-0.5
            ),
            lambda seed: [
                normal(seed, batch, seq, heads, 96),
                normal(seed + 1, batch, seq, heads, 64),
                normal(seed + 2, batch, seq, heads, 32),
                normal(seed + 3, batch, seq, heads, 64),
            ],
        ),
        "kda_chunk_backward": (
            lambda *t: chunk_kda(t[0], t[1], t[2], t[3], t[4], initial_state=t[5], output_final_state=True)[0],
            lambda *t: chunk_kda_autograd_reference(
                t[0], t[1], t[2], t[3], t[4], t[0].shape[-1] ** -0.5, t[5], True, 64
            )[0],
            kda_inputs,
        ),
        "attn_res_mix_rmsnorm": (
            lambda *t: attn_res_mix_rmsnorm(list(t[:-3]), t[-3], t[-2], 1e-6, t[-1], 1e-6),
            mix_reference,
            mix_inputs,
        ),
    }


def check_fused_paths(ctx: Context) -> Iterator[Row]:
    """Each training fast path (written-out backwards, channels-last short convolution, padded-v
    MLA attention, the fused AttnRes mix + norm) in fp32 on the device vs its reference formula
    in float64 on the CPU: output and every input's gradient. ref ms: the reference formula
    (autograd through its ops) in fp32 on the device; fast ms: the fast path, both fwd+bwd."""
    for name, (fast, reference, make_inputs) in fused_path_cases(ctx).items():

        def row(name=name, fast=fast, reference=reference, make_inputs=make_inputs) -> Row:
            inputs = make_inputs(21)

            def run(function, tensors, seed: int) -> dict[str, torch.Tensor]:
                out = function(*tensors)
                dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
                grads = torch.autograd.grad(out, tensors, dout.to(out.device, out.dtype))
                return {"out": out, **{f"d{i}": grad for i, grad in enumerate(grads)}}

            fast_result = run(fast, inputs, 5)
            ref_result = run(reference, to_cpu64(*inputs), 5)
            max_abs, rel, worst = compare({key: (fast_result[key], ref_result[key]) for key in ref_result})
            ref_ms = ctx.time_ms(lambda: run(reference, inputs, 6))
            fast_ms = ctx.time_ms(lambda: run(fast, inputs, 6))
            tol = TOL["fused_path_fp32"]
            shapes = " ".join(str(list(t.shape)) for t in inputs[:2])
            return Row(
                f"fused_paths {name} fp32",
                verdict(rel, tol),
                max_abs,
                rel,
                tol,
                ref_ms,
                fast_ms,
                f"{shapes} vs fp64 CPU reference, fwd+bwd; worst {worst}; ref ms: the reference formula",
            )

        yield guarded(ctx, f"fused_paths {name} fp32", row)
