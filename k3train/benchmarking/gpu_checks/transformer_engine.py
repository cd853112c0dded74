"""Transformer Engine checks: TE's modules as k3train builds them (kernels/te.py) against the
torch path on the same weights, bf16 and each FP8 recipe, float64 references; parameter names
as the torch model's; FP8 state through state_dict()."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from k3train.kernels import te as te_kernels
from k3train.kernels.grouped_gemm import grouped_mm, grouped_mm_reference
from k3train.model.config import ModelConfig
from k3train.model.k3 import K3ModelChunk

from .common import BF16, F64, TOL, Context, Row, compare, error, guarded, skip, to_cpu64, verdict
from .grouped_gemm import group_ends
from .model import token_batch

TE_SHAPES = (  # (in, out, what) of recipes/k3-1gpu.yaml's projections
    (1536, 1536, "KDA q/k/v/g/o, shared experts"),
    (1536, 320, "MLA kv_a"),
    (256, 3072, "MLA kv_b"),
    (7168, 1536, "dense MLP down"),
    (1536, 768, "latent W_down"),
    (1536, 12, "KDA b_proj (kept out of FP8: 12 columns)"),
)


def te_unavailable_reason(ctx: Context):
    """(TE namespace, None) when Transformer Engine runs here, else (None, why not)."""
    if not ctx.cuda:
        return None, f"needs CUDA and Transformer Engine ({te_kernels.INSTALL_HINT})"
    te, why = te_kernels.import_transformer_engine()
    if te is None:
        return None, f"Transformer Engine does not import ({why}); {te_kernels.INSTALL_HINT}"
    return te, None


def fp8_recipes_here(ctx: Context) -> list[str]:
    """The FP8 recipes this GPU runs: delayed and current on Hopper and later, MXFP8 on
    Blackwell, blockwise where TE says Float8BlockScaling runs (Hopper and later, CUDA ≥ 12.9)."""
    major = torch.cuda.get_device_capability(ctx.device)[0]
    te, _ = te_kernels.import_transformer_engine()
    blockwise = te is not None and te_kernels.blockwise_unsupported(te) is None
    return [
        name
        for name in te_kernels.FP8_RECIPES
        if (name != "mxfp8" or major >= 10) and (name != "blockwise" or blockwise)
    ]


def precision_region(te, precision: str, recipe: str | None, device: torch.device):
    """bf16 autocast, plus TE's FP8 region for precision fp8 (what training.build sets up)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device.type, dtype=BF16))
    if precision == "fp8":
        assert recipe is not None, "precision fp8 runs under a named FP8 recipe"
        stack.enter_context(te_kernels.fp8_autocast(te, True, te_kernels.make_fp8_recipe(te, recipe)))
    return stack


def check_transformer_engine(ctx: Context) -> Iterator[Row]:
    """Transformer Engine's modules as k3train builds them (kernels/te.py) against the torch path
    on the same weights and inputs, float64 references on the device: te.Linear at the shapes of
    k3-1gpu's projections and te.GroupedLinear on expert stacks, bf16 (tol 1e-2) and each FP8
    recipe the GPU runs (E4M3 forward, norm-wise rel err ≈ 5e-2 expected: tol 8e-2; E5M2
    gradients ≈ 8e-2: tol 1.5e-1); the same parameter names as the torch model; FP8 state saved
    and loaded bit-exactly. ref ms: torch bf16 (F.linear / grouped_mm); fast ms: TE."""
    te, why = te_unavailable_reason(ctx)
    if te is None:
        yield skip("transformer_engine", why)
        return
    yield guarded(ctx, "transformer_engine names", lambda: te_names_row(ctx, te))
    tokens = ctx.pick(8192, 256)
    for in_features, out_features, what in ctx.pick(TE_SHAPES, TE_SHAPES[:2] + TE_SHAPES[-1:]):
        for precision, recipe in [("bf16", None)] + [("fp8", name) for name in fp8_recipes_here(ctx)]:
            name = f"transformer_engine linear {in_features}x{out_features} {recipe or precision}"
            yield guarded(
                ctx,
                name,
                lambda: te_linear_row(ctx, te, name, tokens, in_features, out_features, precision, recipe, what),
            )
    groups, latent, inner, slots = ctx.pick((128, 768, 768, 16384), (8, 64, 32, 200))
    for precision, recipe in [("bf16", None)] + [("fp8", name) for name in fp8_recipes_here(ctx)]:
        name = f"transformer_engine grouped {recipe or precision}"
        yield guarded(ctx, name, lambda: te_grouped_row(ctx, te, name, groups, latent, inner, slots, precision, recipe))
    yield guarded(ctx, "transformer_engine fp8 state", lambda: te_state_row(ctx, te))


def te_names_row(ctx: Context, te) -> Row:
    """The debug model through TE's modules has the torch model's parameters (names, shapes,
    head blocks) and one forward on the same weights gives the same loss (bf16)."""
    config = ModelConfig()
    torch_model = K3ModelChunk(config).to(ctx.device)
    with torch.device(ctx.device):
        te_model = K3ModelChunk(config, linear_factory=te_kernels.TELinearFactory(te, ctx.device))
    te_model.load_state_dict(torch_model.state_dict(), strict=False)  # TE adds only _extra_state keys
    described = [
        {n: (tuple(p.shape), getattr(p, "head_blocks", None)) for n, p in m.named_parameters()}
        for m in (torch_model, te_model)
    ]
    extra = [k for k in te_model.state_dict() if k not in torch_model.state_dict()]
    tokens, labels = token_batch(config, 2, 64, ctx.device, seed=31)
    losses = []
    for model in (torch_model, te_model):
        with torch.autocast(ctx.device.type, dtype=BF16):
            losses.append(model.loss(model(tokens), labels).detach())
    max_abs, rel = error(losses[1], losses[0])
    same = described[0] == described[1]
    only_extra_state = all(k.endswith("._extra_state") for k in extra)
    return Row(
        "transformer_engine names",
        verdict(rel, TOL["te_linear_bf16"], same, only_extra_state),
        max_abs,
        rel,
        TOL["te_linear_bf16"],
        None,
        None,
        f"{len(described[1])} parameters, same names/shapes/head blocks: {same}; {len(extra)} extra state "
        f"keys only: {only_extra_state}; loss torch {float(losses[0]):.4f} TE {float(losses[1]):.4f} (bf16)",
    )


def te_linear_row(
    ctx: Context,
    te,
    name: str,
    tokens: int,
    in_features: int,
    out_features: int,
    precision: str,
    recipe: str | None,
    what: str,
) -> Row:
    gen = ctx.generator(41)
    x = ctx.randn(tokens, in_features, gen=gen, dtype=BF16)
    weight = ctx.randn(out_features, in_features, gen=gen, scale=in_features**-0.5)
    grad_out = ctx.randn(tokens, out_features, gen=gen, dtype=BF16)
    x64, w64, g64 = x.to(F64), weight.to(F64), grad_out.to(F64)
    ref = {"y": x64 @ w64.T, "dx": g64 @ w64, "dw": g64.T @ x64}
    module = te_kernels.TELinearFactory(te, ctx.device)(in_features, out_features)
    assert isinstance(module.weight, torch.Tensor), "te.Linear's weight is a parameter"
    with torch.no_grad():
        module.weight.copy_(weight)
    fp8_gemm = precision == "fp8" and not module.keep_out_of_fp8

    def te_step():
        xi = x.clone().requires_grad_(True)
        module.weight.grad = None
        with precision_region(te, precision, recipe, ctx.device):
            y = module(xi)
        y.backward(grad_out)
        return y, xi.grad, module.weight.grad

    def torch_step():
        xi, wi = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast(ctx.device.type, dtype=BF16):
            y = F.linear(xi, wi)
        y.backward(grad_out)

    for _ in range(3):  # the delayed recipe's scales come from the amaxes of earlier steps
        te_step()
    y, dx, dw = te_step()
    _, rel_y = error(y, ref["y"])
    max_abs, rel_grad, worst = compare({"dx": (dx, ref["dx"]), "dw": (dw, ref["dw"])})
    tol_y = TOL["te_linear_fp8_fwd"] if fp8_gemm else TOL["te_linear_bf16"]
    tol_grad = TOL["te_linear_fp8_grad"] if fp8_gemm else TOL["te_linear_bf16"]
    ref_ms = ctx.time_ms(torch_step)
    fast_ms = ctx.time_ms(te_step)
    return Row(
        name,
        verdict(rel_y, tol_y, math.isfinite(rel_grad) and rel_grad <= tol_grad),
        max_abs,
        rel_y,
        tol_y,
        ref_ms,
        fast_ms,
        f"{what}; {tokens} tokens fwd+bwd; grads rel {rel_grad:.2e} (worst {worst}, tol "
        f"{tol_grad:.0e}); FP8 GEMM: {fp8_gemm}",
    )


def te_grouped_row(
    ctx: Context, te, name: str, groups: int, latent: int, inner: int, slots: int, precision: str, recipe: str | None
) -> Row:
    """One grouped expert GEMM `[slots, latent] -> [slots, inner]` through GroupedExpertGEMM on a
    stack (uneven groups, one empty) vs float64 per-group matmuls; ref ms: grouped_mm bf16."""
    gen = ctx.generator(43)
    ends = group_ends(ctx, groups, slots, seed=44, empty=[1])
    rows = ctx.randn(slots, latent, gen=gen, dtype=BF16)
    stack = ctx.randn(groups, inner, latent, gen=gen, scale=latent**-0.5).requires_grad_(True)
    grad_out = ctx.randn(slots, inner, gen=gen, dtype=BF16)
    rows64, stack64 = to_cpu64(rows.requires_grad_(True), stack)
    rows = rows.detach()
    out64 = grouped_mm_reference(rows64, stack64.transpose(1, 2), ends.cpu())
    out64.backward(grad_out.to("cpu", F64))
    assert rows64.grad is not None and stack64.grad is not None, "both are leaves that require grad"
    fp8_rows = 16 if recipe is None else te_kernels.FP8_GROUP_ROWS.get(recipe, 16)
    gemm = te_kernels.TELinearFactory(te, ctx.device, fp8_rows=fp8_rows).grouped(groups, latent, inner)

    def te_step():
        xi = rows.clone().requires_grad_(True)
        stack.grad = None
        with precision_region(te, precision, recipe, ctx.device):
            out = gemm(xi, ends, stack)
        out.backward(grad_out)
        return out, xi.grad, stack.grad

    def torch_step():
        xi = rows.clone().requires_grad_(True)
        out = grouped_mm(xi, stack.transpose(1, 2).to(BF16), ends)
        out.backward(grad_out)

    for _ in range(3):
        te_step()
    out, dx, dw = te_step()
    _, rel_y = error(out, out64)
    max_abs, rel_grad, worst = compare({"dx": (dx, rows64.grad), "dw": (dw, stack64.grad)})
    fp8 = precision == "fp8"
    tol_y = TOL["te_linear_fp8_fwd"] if fp8 else TOL["te_linear_bf16"]
    tol_grad = TOL["te_linear_fp8_grad"] if fp8 else TOL["te_linear_bf16"]
    ref_ms, fast_ms = ctx.time_ms(torch_step), ctx.time_ms(te_step)
    return Row(
        name,
        verdict(rel_y, tol_y, math.isfinite(rel_grad) and rel_grad <= tol_grad),
        max_abs,
        rel_y,
        tol_y,
        ref_ms,
        fast_ms,
        f"E={groups} l={latent} I={inner} slots={slots} fwd+bwd, gradients into the stack; "
        f"grads rel {rel_grad:.2e} (worst {worst}, tol {tol_grad:.0e})",
    )


def te_state_row(ctx: Context, te) -> Row:
    """Delayed-scaling FP8 state through `state_dict()` (kernels/te.py's flat tensor, no pickle):
    a fresh module loaded from a trained one computes bit-identical outputs and state."""
    factory = te_kernels.TELinearFactory(te, ctx.device)
    trained, fresh = factory(512, 512), factory(512, 512)
    gen = ctx.generator(47)
    inputs = [ctx.randn(256, 512, gen=gen, dtype=BF16, scale=1.0 + i) for i in range(4)]
    for x in inputs[:3]:
        with precision_region(te, "fp8", "delayed", ctx.device):
            trained(x).float().sum().backward()
    state = trained.state_dict()
    fresh.load_state_dict(state)
    outputs = []
    for module in (trained, fresh):
        with precision_region(te, "fp8", "delayed", ctx.device):
            outputs.append(module(inputs[3]).detach())
    saved = te_kernels.fp8_state_tensor(trained)
    same_out = torch.equal(outputs[0], outputs[1])
    same_state = torch.equal(saved, te_kernels.fp8_state_tensor(fresh))
    extra = state["_extra_state"]
    ok = isinstance(extra, torch.Tensor) and extra.numel() > 7 and same_out and same_state
    return Row(
        "transformer_engine fp8 state",
        "PASS" if ok else "FAIL",
        note=(
            f"extra state: {type(extra).__name__} of {getattr(extra, 'numel', lambda: 0)()} fp32 values; outputs "
            f"bit-identical after loading: {same_out}; state identical: {same_state}"
        ),
    )
