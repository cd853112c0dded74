#!/usr/bin/env python
"""Check every GPU fast path against its reference and time it, in one run.

    python tools/gpu_check.py                         # every check, on CUDA when there is one
    python tools/gpu_check.py --device cpu --quick    # the logic at small sizes (tests/unit runs this)
    python tools/gpu_check.py --only kda_fla --only grouped_mm --json /tmp/rows.json

Each check compares a fast path with a reference in higher precision (float64, mostly on the CPU)
and times the fast path against the path it replaces on the same device (median of several runs
after warm-up, CUDA events on the GPU). One table row per case:

    check | max abs | rel err | tol | status | ref ms | fast ms | speed-up | note

`rel err` is the norm-wise relative error ‖fast − ref‖ / ‖ref‖ of the worst tensor of the case
(outputs, final states and gradients; the note names it), `tol` the bound on it. A NaN or Inf in
a fast result always fails. What `ref ms` and `fast ms` time is in each check's docstring and the
note. SKIP rows say why (no CUDA, fla-core missing, several GPUs needed). The exit code is 1 if
any row FAILs, 0 otherwise.

`fused_paths` holds each training fast path of the CPU work (written-out backwards of the KDA
chunk kernel, short convolution, norms, decay gate, SiTU-GLU with routing weights, the fused
AttnRes mix + norm; MLA attention with v padded to the q/k head dim) to its reference formula,
since the same code runs on the GPU.

Sizes: on CUDA without `--quick`, K3-like shapes (KDA heads of 128, 56 local experts of
3584 x 3072, 8192 slots, ...), sized to finish in a few minutes on one H200. With `--quick` or
on the CPU, small shapes that only exercise the logic.

On the device machine fla-core is not preinstalled: carry its wheel (pure Python, needs einops,
which is there) or the `kda_fla` rows SKIP and the model runs KDA on the PyTorch path. The same
holds for transformer-engine (`pip install transformer-engine[pytorch]`, a CUDA build): without
it the `transformer_engine` rows and the fp8 runs of `k3_1gpu` SKIP.

`k3_1gpu` trains recipes/k3-1gpu.yaml (every K3 feature, 1.1B active parameters) for 50 steps in
bf16 and in fp8 from the same weights and batches, compares the loss curves, and prints a table
of tokens/s, TFLOP/s, MFU (against the GPU's dense bf16 peak from tools/hardware/) and peak
memory for bf16 and fp8, with Block AttnRes and without; `--json PATH` writes the rows, that
table and the loss curves. The whole script is sized for under 8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib.metadata
import importlib.util
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

# The checkout root goes first on sys.path: this script checks the kernels of *this* working tree
# (run as `python tools/gpu_check.py`, sys.path[0] would be tools/, and an installed k3train wheel
# could shadow the checkout). `import k3train` then mounts kernels/ and parallel/ as
# k3train.kernels and k3train.parallel.
CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from k3train.kernels.attn_res import attn_res_mix  # noqa: E402
from k3train.kernels.grouped_gemm import grouped_mm, grouped_mm_reference  # noqa: E402
from k3train.kernels.kda import chunk_kda, fla_backend, naive_recurrent_kda  # noqa: E402
from k3train.kernels.situ_glu import situ_glu, situ_glu_reference  # noqa: E402
from k3train.kernels.attn_res import attn_res_mix_reference, attn_res_mix_rmsnorm  # noqa: E402
from k3train.kernels.kda import kda_gate, kda_gate_reference  # noqa: E402
from k3train.kernels.kda.chunk import chunk_kda_autograd_reference  # noqa: E402
from k3train.kernels.norms import gated_rms_norm, gated_rms_norm_reference, l2_normalize, l2_normalize_reference  # noqa: E402
from k3train.kernels.short_conv import short_conv_silu, short_conv_silu_reference  # noqa: E402
from k3train.model.mla import causal_attention, causal_attention_reference  # noqa: E402
from k3train.kernels import te as te_kernels  # noqa: E402
from k3train.config import load_config  # noqa: E402
from k3train.model.flops import training_flops_per_token  # noqa: E402
from k3train.optim.builder import build_optimizer  # noqa: E402
from k3train.planning.hardware import load_profile  # noqa: E402
from k3train.training.build import forward_precision_context, fp8_excluded_layers  # noqa: E402
from k3train.training.throughput import peak_flops  # noqa: E402
from k3train.model.config import LinearAttnConfig, ModelConfig  # noqa: E402
from k3train.model.k3 import K3Model  # noqa: E402
from k3train.optim.newton_schulz import newton_schulz, ns_compute_dtype  # noqa: E402

F64 = torch.float64
BF16 = torch.bfloat16
F32 = torch.float32

# Norm-wise relative tolerances. fp32 paths land far under 1e-3; anything that rounds operands or
# results to bf16 (8 significant bits, 2^-9 ≈ 2e-3 per element) lands between 1e-3 and 1e-2;
# Triton's float32 dots run in tf32 (10 bits). Five bf16 Newton–Schulz steps differ from the fp64
# iteration by about 2.5e-2 at every shape tried on the CPU (16x96 up to 128x7168): the quintic's
# steep slope amplifies the rounding, which Muon tolerates (only the singular-value band matters).
TOL = {
    "kda_torch_fp32": 1e-4,
    "kda_torch_bf16": 1e-2,
    "kda_fla_fp32": 1e-2,
    "kda_fla_bf16": 2e-2,
    "kda_fla_vs_torch": 2e-2,
    "grouped_mm_fp32": 1e-3,
    "grouped_mm_bf16": 1e-2,
    "grouped_mm_speed": 2e-2,
    "attn_res_bf16": 1e-2,
    "situ_glu_bf16": 1e-2,
    # The training fast paths (written-out backwards, fused layouts) in fp32 against their
    # references in float64: fp32 rounding of the same formula, reductions over <= 4096 terms.
    "fused_path_fp32": 1e-4,
    "newton_schulz_bf16": 5e-2,
    "model_loss_bf16": 1e-2,
    # Transformer Engine: bf16 GEMMs as torch's; FP8 E4M3 operands (3 mantissa bits, RMS rounding
    # ≈ 3.6% each) give ≈ 5e-2 norm-wise in the output; gradients meet E5M2 (2 bits) under HYBRID.
    "te_linear_bf16": 1e-2,
    "te_linear_fp8_fwd": 8e-2,
    "te_linear_fp8_grad": 1.5e-1,
    # 50 steps of recipes/k3-1gpu.yaml from the same weights and batches: fp8's loss, mean of the
    # last 10 steps, relative to bf16's.
    "k3_1gpu_loss_fp8": 3e-2,
}
NS_SINGULAR_BAND = (0.5, 1.5)


# ---------------------------------------------------------------------------------------------
# Rows, timing and error measures


@dataclasses.dataclass
class Row:
    name: str
    status: str  # PASS, FAIL or SKIP
    max_abs: Optional[float] = None
    rel: Optional[float] = None
    tol: Optional[float] = None
    ref_ms: Optional[float] = None
    fast_ms: Optional[float] = None
    note: str = ""

    @property
    def speedup(self) -> Optional[float]:
        if self.ref_ms is None or self.fast_ms is None or self.fast_ms <= 0:
            return None
        return self.ref_ms / self.fast_ms


def skip(name: str, reason: str, ref_ms: Optional[float] = None) -> Row:
    return Row(name, "SKIP", ref_ms=ref_ms, note=reason)


@dataclasses.dataclass
class Context:
    device: torch.device
    quick: bool
    results: dict = dataclasses.field(default_factory=dict)  # extra JSON sections (k3_1gpu's table)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def small(self) -> bool:
        """Small shapes: `--quick`, or any CPU run."""
        return self.quick or not self.cuda

    def pick(self, full, small):
        return small if self.small else full

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def randn(self, *shape: int, gen: torch.Generator, dtype: torch.dtype = F32, scale: float = 1.0) -> torch.Tensor:
        """Fresh normal values on the device (drawn in fp32, then rounded to `dtype`)."""
        return (torch.randn(shape, generator=gen, device=gen.device, dtype=F32) * scale).to(dtype)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_ms(self, fn: Callable[[], object], reps: Optional[int] = None, warmup: Optional[int] = None) -> float:
        """Median milliseconds of `fn()` after warm-up: CUDA events on the GPU, a host clock on
        the CPU. Host syncs inside `fn` (e.g. `.tolist()`) count: they are part of its cost."""
        warmup = (1 if self.small else 3) if warmup is None else warmup
        reps = (3 if self.small else 10) if reps is None else reps
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                start_s = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - start_s))
        return statistics.median(times)

    def wall_ms(self, fn: Callable[[], object]) -> float:
        """One call, synchronised (first calls: compilation, autotuning)."""
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return 1e3 * (time.perf_counter() - start)


def error(fast: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """`(max |fast − ref|, ‖fast − ref‖ / ‖ref‖)` in float64 on `fast`'s device; inf for a
    non-finite fast value or a shape mismatch."""
    fast = fast.detach()
    ref = ref.detach().to(fast.device)
    if fast.shape != ref.shape:
        return math.inf, math.inf
    if fast.numel() == 0:
        return 0.0, 0.0
    fast64, ref64 = fast.to(F64), ref.to(F64)
    if not torch.isfinite(fast64).all():
        return math.inf, math.inf
    diff = fast64 - ref64
    diff_norm, ref_norm = float(diff.norm()), float(ref64.norm())
    rel = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    return float(diff.abs().max()), rel


def compare(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float, str]:
    """Largest max-abs error, worst relative error and the name of the worst tensor."""
    worst_abs, worst_rel, worst_name = 0.0, -1.0, ""
    for name, (fast, ref) in pairs.items():
        max_abs, rel = error(fast, ref)
        worst_abs = max(worst_abs, max_abs)
        if rel > worst_rel:
            worst_rel, worst_name = rel, name
    return worst_abs, max(worst_rel, 0.0), worst_name


def verdict(rel: float, tol: float, *conditions: bool) -> str:
    return "PASS" if math.isfinite(rel) and rel <= tol and all(conditions) else "FAIL"


def to_cpu64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Exact float64 CPU copies (every fp32/bf16 value is a float64), as fresh autograd leaves."""
    return [t.detach().to("cpu", F64).requires_grad_(t.requires_grad) for t in tensors]


def fla_unavailable_reason(ctx: Context) -> Optional[str]:
    """None when fla's kernel can run here; otherwise why not (fla is only imported on CUDA)."""
    if not ctx.cuda:
        return "needs CUDA (fla's Triton kernels)"
    if fla_backend.load_fla_chunk_kda() is None:
        return "fla-core does not import here: carry its wheel (pip extra 'gpu')"
    return None


def package_version(module: str, distribution: str) -> str:
    """The installed version of `distribution`, "absent" if `module` cannot be found (nothing is
    imported)."""
    if importlib.util.find_spec(module) is None:
        return "absent"
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "present"


# ---------------------------------------------------------------------------------------------
# 1. Kimi Delta Attention


KDA_TENSORS = ("q", "k", "v", "g", "beta", "initial_state")


def kda_inputs(ctx: Context, batch: int, seq: int, heads: int, dim: int, dtype: torch.dtype,
               seed: int) -> dict[str, torch.Tensor]:
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


def kda_forward_backward(kernel: Callable, inputs: dict[str, torch.Tensor],
                         cotangents: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Output, final state and the gradients of every input under the given cotangents."""
    o, state = kernel(**inputs, output_final_state=True)
    do, dstate = cotangents
    grads = torch.autograd.grad((o, state), [inputs[n] for n in KDA_TENSORS],
                                (do.to(o.dtype), dstate.to(state.dtype)))
    return {"o": o, "final_state": state, **{f"d{n}": g for n, g in zip(KDA_TENSORS, grads)}}


def kda_reference(inputs: dict[str, torch.Tensor], cotangents: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """The token-by-token recurrence in float64 on the CPU, on exactly the same inputs."""
    inputs64 = dict(zip(inputs, to_cpu64(*inputs.values())))
    return kda_forward_backward(naive_recurrent_kda, inputs64, tuple(to_cpu64(*cotangents)))


def kda_accuracy_row(ctx: Context, name: str, kernel: Callable, ref_kernel: Callable, dtype: torch.dtype,
                     tol: float, note: str) -> Row:
    # T not a multiple of 64; on CUDA the heads of kda_speed, so fla's autotuner sees one shape.
    batch, seq, heads, dim = ctx.pick((1, 150, 16, 128), (1, 100, 2, 32))
    inputs = kda_inputs(ctx, batch, seq, heads, dim, dtype, seed=1)
    cotangents = kda_cotangents(ctx, inputs, seed=2)
    first_ms = ctx.wall_ms(lambda: kda_forward_backward(kernel, inputs, cotangents))
    fast = kda_forward_backward(kernel, inputs, cotangents)
    ref = kda_reference(inputs, cotangents)
    max_abs, rel, worst = compare({key: (fast[key], ref[key]) for key in ref})
    ref_ms = ctx.time_ms(lambda: kda_forward_backward(ref_kernel, inputs, cotangents), reps=ctx.pick(5, 1),
                         warmup=ctx.pick(2, 0))
    fast_ms = ctx.time_ms(lambda: kda_forward_backward(kernel, inputs, cotangents))
    return Row(name, verdict(rel, tol), max_abs, rel, tol, ref_ms, fast_ms,
               f"B={batch} T={seq} H={heads} K=V={dim} fwd+bwd, h0; worst {worst}; {note}; "
               f"first call {first_ms:.0f} ms")


def check_kda_chunk(ctx: Context) -> Iterator[Row]:
    """chunk_kda's PyTorch path vs the float64 recurrence: output, final state, all six gradients.
    ref ms: naive_recurrent_kda on the device; fast ms: chunk_kda(backend="torch")."""
    torch_chunk = lambda **kw: chunk_kda(**kw, backend="torch")  # noqa: E731
    for dtype, tol in ((F32, TOL["kda_torch_fp32"]), (BF16, TOL["kda_torch_bf16"])):
        name = f"kda_chunk {'fp32' if dtype == F32 else 'bf16'}"
        yield guarded(ctx, name, lambda: kda_accuracy_row(
            ctx, name, torch_chunk, naive_recurrent_kda, dtype, tol, "ref ms: naive recurrence"))


def check_kda_fla(ctx: Context) -> Iterator[Row]:
    """fla's Triton chunk_kda vs the float64 recurrence (as check_kda_chunk).
    ref ms: chunk_kda(backend="torch"); fast ms: chunk_kda(backend="fla")."""
    reason = fla_unavailable_reason(ctx)
    for dtype, tol in ((F32, TOL["kda_fla_fp32"]), (BF16, TOL["kda_fla_bf16"])):
        name = f"kda_fla {'fp32' if dtype == F32 else 'bf16'}"
        if reason:
            yield skip(name, reason)
            continue
        yield guarded(ctx, name, lambda: kda_accuracy_row(
            ctx, name, lambda **kw: chunk_kda(**kw, backend="fla"), lambda **kw: chunk_kda(**kw, backend="torch"),
            dtype, tol, "ref ms: torch chunk path"))


def check_kda_speed(ctx: Context) -> Iterator[Row]:
    """fla vs the PyTorch chunk path at training lengths, bf16 q/k/v (fp32 g, beta, state), fwd+bwd.
    The error is fla's output and gradients against the PyTorch path's. Without fla the PyTorch
    path is still timed (a SKIP row with its ref ms).
    ref ms: chunk_kda(backend="torch"); fast ms: chunk_kda(backend="fla")."""
    reason = fla_unavailable_reason(ctx)
    for seq in ctx.pick((4096, 16384), (128,)):
        name = f"kda_speed T={seq}"
        yield guarded(ctx, name, lambda: kda_speed_row(ctx, name, seq, reason))


def kda_speed_row(ctx: Context, name: str, seq: int, fla_missing: Optional[str]) -> Row:
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
    return Row(name, verdict(rel, tol), max_abs, rel, tol, ref_ms, fast_ms,
               f"{shape}; fla vs torch path, worst {worst}; fla first call {first_ms:.0f} ms")


# ---------------------------------------------------------------------------------------------
# 2. Grouped GEMM


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
    dout[end:] = 0  # as LocalExperts.grouped_forward masks the rows of empty slots

    def run(mm: Callable) -> dict[str, torch.Tensor]:
        out = mm(x_of(x_leaf), w_of(w_leaf), ends)
        dx, dw = torch.autograd.grad(out, (x_leaf, w_leaf), dout[: out.shape[0]].to(out.dtype))
        return {"out": out, "dx": dx, "dw": dw}

    fast = run(grouped_mm)
    x64, w64 = to_cpu64(x_leaf, w_leaf)
    out64 = grouped_mm_reference(x_of(x64), w_of(w64), ends.cpu())  # rows up to the last group end
    dx64, dw64 = torch.autograd.grad(out64, (x64, w64), dout[:end].to("cpu", F64))
    max_abs, rel, worst = compare({"out": (fast["out"][:end], out64), "dx": (fast["dx"][:end], dx64[:end]),
                                   "dw": (fast["dw"], dw64)})
    empty_zero = bool((fast["dw"][empty] == 0).all())
    ref_ms = ctx.time_ms(lambda: run(grouped_mm_reference))
    fast_ms = ctx.time_ms(lambda: run(grouped_mm))
    path = "torch._grouped_mm" if (ctx.cuda and hasattr(torch, "_grouped_mm")) else "loop (CPU)"
    note = (f"G={groups} rows={rows} {d_in}->{d_out} empty={empty} fwd+bwd via {path}; worst {worst}; "
            f"empty-group dw zero: {empty_zero}")
    if tail:
        tail_dx = fast["dx"][end:]
        note += (f"; {tail} tail rows, dx there finite: {bool(torch.isfinite(tail_dx).all())}, "
                 f"zero: {bool((tail_dx == 0).all())} (not gated)")
    tol = TOL["grouped_mm_fp32" if dtype == F32 else "grouped_mm_bf16"]
    return Row(name, verdict(rel, tol, empty_zero), max_abs, rel, tol, ref_ms, fast_ms, note)


def expert_glu_chain(mm: Callable, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                     ends: torch.Tensor) -> torch.Tensor:
    """The routed experts as `LocalExperts.forward_sorted` runs them (weights `[E, out, in]`)."""
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
    yield Row("grouped_mm_speed", verdict(rel, tol), max_abs, rel, tol, ref_ms, fast_ms,
              f"E={experts} l={latent} I={inner} slots={slots} bf16 fwd+bwd; worst {worst} (vs loop); "
              f"{flop / fast_ms / 1e9:.1f} TFLOP/s grouped, {flop / ref_ms / 1e9:.1f} loop; "
              f"first call {first_ms:.0f} ms")


# ---------------------------------------------------------------------------------------------
# 3. Attention Residuals mix and SiTU-GLU


def check_attn_res(ctx: Context) -> Iterator[Row]:
    """attn_res_mix with bf16 sources (fp32 norm gain and query, as in the model) vs float64 on
    the CPU, output and all gradients. Timed at a larger shape.
    ref ms: the same op on fp32 sources on the device; fast ms: on bf16 sources."""
    n_sources, eps = 9, 1e-5

    def inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[list, torch.Tensor, torch.Tensor]:
        """Sources of growing scale in `dtype`; fp32 norm gain near 1 and a query giving O(1) scores."""
        gen = ctx.generator(seed)
        d = shape[-1]
        sources = [ctx.randn(*shape, gen=gen, dtype=dtype, scale=1.0 + i / 2).requires_grad_()
                   for i in range(n_sources)]
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
    timed = {dtype: (*inputs(time_shape, dtype, seed=11), ctx.randn(*time_shape, gen=ctx.generator(12), dtype=dtype))
             for dtype in (F32, BF16)}
    ref_ms = ctx.time_ms(lambda: run(*timed[F32]))
    fast_ms = ctx.time_ms(lambda: run(*timed[BF16]))
    tol = TOL["attn_res_bf16"]
    yield Row("attn_res bf16", verdict(rel, tol), max_abs, rel, tol, ref_ms, fast_ms,
              f"{n_sources} sources {list(shape)} vs fp64 CPU, fwd+bwd; worst {worst}; "
              f"timed at {list(time_shape)}, ref ms: fp32 sources")


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
    ref = run(*to_cpu64(gate, up), dout.to("cpu", F64))
    max_abs, rel, worst = compare({key: (fast[key], ref[key]) for key in ref})
    timed = {dtype: inputs(dtype, seed=14) for dtype in (F32, BF16)}
    ref_ms = ctx.time_ms(lambda: run(*timed[F32]))
    fast_ms = ctx.time_ms(lambda: run(*timed[BF16]))
    tol = TOL["situ_glu_bf16"]
    yield Row("situ_glu bf16", verdict(rel, tol), max_abs, rel, tol, ref_ms, fast_ms,
              f"[{rows}, {inner}] vs fp64 CPU, fwd+bwd; worst {worst}; ref ms: fp32 inputs")


def fused_path_cases(ctx: Context) -> dict[str, tuple[Callable, Callable, Callable[[int], list[torch.Tensor]]]]:
    """name -> (fast, reference, inputs(seed)): each training fast path with a written-out
    backward and the plain formula it replaces (the pairs the unit tests hold together in float64)."""
    batch, seq, heads, dim = ctx.pick((2, 4096, 16, 128), (2, 40, 2, 16))
    width, hidden = heads * dim, ctx.pick(7168, 64)

    def normal(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return ctx.randn(*shape, gen=ctx.generator(seed), scale=scale).requires_grad_()

    def kda_inputs(seed: int) -> list[torch.Tensor]:
        q, k = (F.normalize(normal(seed + i, batch, seq, heads, dim), dim=-1).detach().requires_grad_()
                for i in range(2))
        v = normal(seed + 2, batch, seq, heads, dim)
        g = (-5 * torch.rand(batch, seq, heads, dim, generator=ctx.generator(seed + 3), device=ctx.device)).requires_grad_()
        beta = torch.rand(batch, seq, heads, generator=ctx.generator(seed + 4), device=ctx.device).requires_grad_()
        return [q, k, v, g, beta, normal(seed + 5, batch, heads, dim, dim, scale=0.1)]

    def mix_inputs(seed: int) -> list[torch.Tensor]:
        sources = [normal(seed + i, batch, seq, hidden, scale=1 + i / 2) for i in range(5)]
        return [*sources, (1 + normal(seed + 9, hidden, scale=0.1)).detach().requires_grad_(),
                normal(seed + 10, hidden, scale=hidden ** -0.5), (1 + normal(seed + 11, hidden, scale=0.1)).detach().requires_grad_()]

    def mix_reference(*tensors):
        *sources, norm_weight, query, out_weight = tensors
        mixed = attn_res_mix_reference(sources, norm_weight, query, 1e-6).float()
        return (mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + 1e-6) * out_weight).to(sources[0].dtype)

    return {
        "short_conv_silu": (lambda x, w, tail: short_conv_silu(x, w, tail)[0],
                            lambda x, w, tail: short_conv_silu_reference(x, w, tail)[0],
                            lambda seed: [normal(seed, batch, seq, width), normal(seed + 1, width, 1, 4, scale=0.5),
                                          normal(seed + 2, batch, width, 3)]),
        "l2_normalize": (l2_normalize, l2_normalize_reference, lambda seed: [normal(seed, batch, seq, heads, dim)]),
        "gated_rms_norm": (lambda x, gate, w: gated_rms_norm(x, gate, w, 1e-5),
                           lambda x, gate, w: gated_rms_norm_reference(x, gate, w, 1e-5),
                           lambda seed: [normal(seed, batch, seq, heads, dim), normal(seed + 1, batch, seq, heads, dim),
                                         (1 + normal(seed + 2, dim, scale=0.1)).detach().requires_grad_()]),
        "kda_gate": (kda_gate, kda_gate_reference,
                     lambda seed: [normal(seed, batch, seq, heads, dim), normal(seed + 1, heads, scale=0.5),
                                   normal(seed + 2, heads * dim, scale=0.5)]),
        "situ_glu_row_scale": (lambda gate, up, scale: situ_glu(gate, up, row_scale=scale),
                               lambda gate, up, scale: situ_glu_reference(gate, up) * scale.unsqueeze(-1),
                               lambda seed: [normal(seed, batch * seq, 4 * dim, scale=3.0),
                                             normal(seed + 1, batch * seq, 4 * dim, scale=3.0),
                                             torch.rand(batch * seq, generator=ctx.generator(seed + 2),
                                                        device=ctx.device).requires_grad_()]),
        "mla_padded_v_attention": (lambda q, k_nope, k_rope, v: causal_attention(q, k_nope, k_rope, v, 96 ** -0.5),
                                   lambda q, k_nope, k_rope, v: causal_attention_reference(
                                       q, torch.cat([k_nope, k_rope], dim=-1), v, 96 ** -0.5),
                                   lambda seed: [normal(seed, batch, seq, heads, 96), normal(seed + 1, batch, seq, heads, 64),
                                                 normal(seed + 2, batch, seq, heads, 32), normal(seed + 3, batch, seq, heads, 64)]),
        "kda_chunk_backward": (lambda *t: chunk_kda(*t[:5], initial_state=t[5], output_final_state=True)[0],
                               lambda *t: chunk_kda_autograd_reference(*t[:5], t[0].shape[-1] ** -0.5, t[5], True, 64)[0],
                               kda_inputs),
        "attn_res_mix_rmsnorm": (lambda *t: attn_res_mix_rmsnorm(list(t[:-3]), t[-3], t[-2], 1e-6, t[-1], 1e-6),
                                 mix_reference, mix_inputs),
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
            return Row(f"fused_paths {name} fp32", verdict(rel, tol), max_abs, rel, tol, ref_ms, fast_ms,
                       f"{shapes} vs fp64 CPU reference, fwd+bwd; worst {worst}; ref ms: the reference formula")
        yield guarded(ctx, f"fused_paths {name} fp32", row)


# ---------------------------------------------------------------------------------------------
# 4. Newton–Schulz


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
    pick bf16. Timed on random fp32 momenta.
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
    default_dtype = ns_compute_dtype(torch.zeros(1, 1, device=ctx.device))
    default_ok = default_dtype == (BF16 if ctx.cuda else F32)
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
    return Row(name, verdict(rel, tol, in_band, default_ok), max_abs, rel, tol, ref_ms, fast_ms,
               f"timed {batch}x[{rows},{cols}]; checked {check_batch} of them vs fp64 NS; "
               f"sv bf16 [{low:.3f}, {high:.3f}] fp64 [{float(sv_ref.min()):.3f}, {float(sv_ref.max()):.3f}] "
               f"band {list(NS_SINGULAR_BAND)}; default compute dtype {str(default_dtype)[6:]}")


# ---------------------------------------------------------------------------------------------
# 5. The model


def large_config() -> ModelConfig:
    """A ~0.4B-parameter K3-shaped model: hidden 1024, 8 layers, 64 experts (top-8)."""
    return ModelConfig(
        vocab_size=32768, hidden_size=1024, num_hidden_layers=8,
        num_attention_heads=8, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        linear_attn_config=LinearAttnConfig(num_heads=8, head_dim=128),
        intermediate_size=2816, num_experts=64, num_experts_per_token=8, num_shared_experts=1,
        moe_intermediate_size=384, routed_expert_hidden_size=512, attn_res_block_size=2,
    )


def train_step(model: K3Model, tokens: torch.Tensor, labels: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Forward (under bf16 autocast if asked) and backward; returns the loss."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(tokens.device.type, dtype=BF16, enabled=bf16):
        logits = model(tokens)
    loss = model.loss(logits, labels)
    loss.backward()
    return loss.detach()


def token_batch(config: ModelConfig, batch: int, seq: int, device: torch.device,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def gradients(model: K3Model) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def kda_backend_in_use(ctx: Context) -> str:
    return "fla" if fla_unavailable_reason(ctx) is None else "torch"


def model_speed_row(ctx: Context, name: str, config: ModelConfig, batch: int, seq: int) -> Row:
    """bf16-autocast vs fp32 training steps of one model on the device: the loss difference,
    finite gradients, tokens/s. The bf16 step (what training runs) goes first; if the fp32 step
    fails the row fails but keeps the bf16 numbers. ref ms: the fp32 step; fast ms: the bf16 step."""
    model = K3Model(config).to(ctx.device)
    params = sum(p.numel() for p in model.parameters())
    tokens, labels = token_batch(config, batch, seq, ctx.device, seed=17)
    reps, warmup = ctx.pick(5, 1), ctx.pick(2, 0)  # the step before each timing warms up too
    loss16 = train_step(model, tokens, labels, bf16=True)
    finite = all(bool(torch.isfinite(g).all()) for g in gradients(model).values())
    fast_ms = ctx.time_ms(lambda: train_step(model, tokens, labels, bf16=True), reps=reps, warmup=warmup)
    note = (f"{params / 1e6:.1f}M params, B={batch} T={seq}: {batch * seq / fast_ms * 1e3:,.0f} tok/s bf16; "
            f"loss {float(loss16):.4f}; grads finite: {finite}; KDA backend {kda_backend_in_use(ctx)}")
    try:
        loss32 = train_step(model, tokens, labels, bf16=False)
        ref_ms = ctx.time_ms(lambda: train_step(model, tokens, labels, bf16=False), reps=reps, warmup=warmup)
    except Exception as exc:  # noqa: BLE001 - keep the bf16 numbers
        traceback.print_exc(file=sys.stderr)
        return Row(name, "FAIL", fast_ms=fast_ms, note=f"{note}; fp32 step failed: {describe(exc)}")
    max_abs, rel = error(loss16, loss32)
    tol = TOL["model_loss_bf16"]
    return Row(name, verdict(rel, tol, finite), max_abs, rel, tol, ref_ms, fast_ms,
               f"{note}; {batch * seq / ref_ms * 1e3:,.0f} tok/s fp32")


def check_model_debug(ctx: Context) -> Iterator[Row]:
    """The debug model (`ModelConfig()`): one step under bf16 autocast on the device vs fp32 on
    the CPU, same weights: loss difference, finite gradients, and the global relative gradient
    difference (noted, not gated: bf16 may flip near-tied expert choices, which moves the expert
    gradients). Then fp32 vs bf16 steps timed on the device (model_speed_row)."""
    yield guarded(ctx, "model_debug bf16-vs-cpu-fp32", lambda: model_debug_accuracy_row(ctx))
    batch, seq = ctx.pick((8, 1024), (2, 64))
    name = "model_debug speed"
    yield guarded(ctx, name, lambda: model_speed_row(ctx, name, ModelConfig(), batch, seq))


def model_debug_accuracy_row(ctx: Context) -> Row:
    config = ModelConfig()
    cpu_model = K3Model(config)
    device_model = copy.deepcopy(cpu_model).to(ctx.device)
    tokens, labels = token_batch(config, 2, 64, torch.device("cpu"), seed=18)
    loss_ref = train_step(cpu_model, tokens, labels, bf16=False)
    loss_fast = train_step(device_model, tokens.to(ctx.device), labels.to(ctx.device), bf16=True)
    grads_ref, grads_fast = gradients(cpu_model), gradients(device_model)
    finite = all(bool(torch.isfinite(g).all()) for g in grads_fast.values())
    same_params = grads_ref.keys() == grads_fast.keys()
    diff2 = sum(float((grads_fast[n].to("cpu", F64) - grads_ref[n].to(F64)).pow(2).sum()) for n in grads_ref)
    ref2 = sum(float(grads_ref[n].to(F64).pow(2).sum()) for n in grads_ref)
    grad_rel = math.sqrt(diff2 / ref2) if ref2 > 0 else math.inf
    max_abs, rel = error(loss_fast, loss_ref)
    tol = TOL["model_loss_bf16"]
    return Row("model_debug bf16-vs-cpu-fp32", verdict(rel, tol, finite, same_params), max_abs, rel, tol, None, None,
               f"B=2 T=64; loss {float(loss_ref):.4f} vs {float(loss_fast):.4f}; {len(grads_fast)} grads, "
               f"finite: {finite}; global grad rel diff {grad_rel:.2e} (not gated)")


def check_model_large(ctx: Context) -> Iterator[Row]:
    """A larger K3-shaped model (hidden 1024, 8 layers, 64 experts): bf16 vs fp32 loss on the
    device, finite gradients, tokens/s. CUDA only (too large for a CPU test run)."""
    if not ctx.cuda:
        yield skip("model_large", "needs CUDA (a ~0.4B-parameter model)")
        return
    batch, seq = ctx.pick((4, 2048), (1, 512))
    yield guarded(ctx, "model_large", lambda: model_speed_row(ctx, "model_large", large_config(), batch, seq))


# ---------------------------------------------------------------------------------------------
# 6. Not checked on one GPU


def check_expert_dispatch(ctx: Context) -> Iterator[Row]:
    """ExpertParallel's all-to-all dispatch needs several ranks: nothing meaningful on one GPU."""
    yield skip("expert_dispatch", "needs >= 2 GPUs (all-to-all over an EP group); covered on CPU/gloo by "
               "tests/distributed/test_expert_parallel.py; its local expert GEMMs are grouped_mm_speed")



# ---------------------------------------------------------------------------------------------
# 7. Transformer Engine: each TE module against the torch module


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
    """The FP8 recipes this GPU runs: delayed and current on Hopper and later, MXFP8 on Blackwell."""
    major = torch.cuda.get_device_capability(ctx.device)[0]
    return [name for name in te_kernels.FP8_RECIPES if name != "mxfp8" or major >= 10]


def precision_region(te, precision: str, recipe: Optional[str], device: torch.device):
    """bf16 autocast, plus TE's FP8 region for precision fp8 (what training.build sets up)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device.type, dtype=BF16))
    if precision == "fp8":
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
            yield guarded(ctx, name, lambda: te_linear_row(ctx, te, name, tokens, in_features, out_features,
                                                             precision, recipe, what))
    groups, latent, inner, slots = ctx.pick((128, 768, 768, 16384), (8, 64, 32, 200))
    for precision, recipe in [("bf16", None)] + [("fp8", name) for name in fp8_recipes_here(ctx)]:
        name = f"transformer_engine grouped {recipe or precision}"
        yield guarded(ctx, name, lambda: te_grouped_row(ctx, te, name, groups, latent, inner, slots, precision, recipe))
    yield guarded(ctx, "transformer_engine fp8 state", lambda: te_state_row(ctx, te))


def te_names_row(ctx: Context, te) -> Row:
    """The debug model through TE's modules has the torch model's parameters (names, shapes,
    head blocks) and one forward on the same weights gives the same loss (bf16)."""
    config = ModelConfig()
    torch_model = K3Model(config).to(ctx.device)
    with torch.device(ctx.device):
        te_model = K3Model(config, linear_factory=te_kernels.TELinearFactory(te, ctx.device))
    te_model.load_state_dict(torch_model.state_dict(), strict=False)  # TE adds only _extra_state keys
    described = [{n: (tuple(p.shape), getattr(p, "head_blocks", None)) for n, p in m.named_parameters()}
                 for m in (torch_model, te_model)]
    extra = [k for k in te_model.state_dict() if k not in torch_model.state_dict()]
    tokens, labels = token_batch(config, 2, 64, ctx.device, seed=31)
    losses = []
    for model in (torch_model, te_model):
        with torch.autocast(ctx.device.type, dtype=BF16):
            losses.append(model.loss(model(tokens), labels).detach())
    max_abs, rel = error(losses[1], losses[0])
    same = described[0] == described[1]
    only_extra_state = all(k.endswith("._extra_state") for k in extra)
    return Row("transformer_engine names", verdict(rel, TOL["te_linear_bf16"], same, only_extra_state), max_abs, rel,
               TOL["te_linear_bf16"], None, None,
               f"{len(described[1])} parameters, same names/shapes/head blocks: {same}; {len(extra)} extra state "
               f"keys only: {only_extra_state}; loss torch {float(losses[0]):.4f} TE {float(losses[1]):.4f} (bf16)")


def te_linear_row(ctx: Context, te, name: str, tokens: int, in_features: int, out_features: int,
                  precision: str, recipe: Optional[str], what: str) -> Row:
    gen = ctx.generator(41)
    x = ctx.randn(tokens, in_features, gen=gen, dtype=BF16)
    weight = ctx.randn(out_features, in_features, gen=gen, scale=in_features ** -0.5)
    grad_out = ctx.randn(tokens, out_features, gen=gen, dtype=BF16)
    x64, w64, g64 = x.to(F64), weight.to(F64), grad_out.to(F64)
    ref = {"y": x64 @ w64.T, "dx": g64 @ w64, "dw": g64.T @ x64}
    module = te_kernels.TELinearFactory(te, ctx.device)(in_features, out_features)
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
    return Row(name, verdict(rel_y, tol_y, math.isfinite(rel_grad) and rel_grad <= tol_grad), max_abs, rel_y, tol_y,
               ref_ms, fast_ms, f"{what}; {tokens} tokens fwd+bwd; grads rel {rel_grad:.2e} (worst {worst}, tol "
               f"{tol_grad:.0e}); FP8 GEMM: {fp8_gemm}")


def te_grouped_row(ctx: Context, te, name: str, groups: int, latent: int, inner: int, slots: int,
                   precision: str, recipe: Optional[str]) -> Row:
    """One grouped expert GEMM `[slots, latent] -> [slots, inner]` through GroupedExpertGEMM on a
    stack (uneven groups, one empty) vs float64 per-group matmuls; ref ms: grouped_mm bf16."""
    gen = ctx.generator(43)
    ends = group_ends(ctx, groups, slots, seed=44, empty=[1])
    rows = ctx.randn(slots, latent, gen=gen, dtype=BF16)
    stack = ctx.randn(groups, inner, latent, gen=gen, scale=latent ** -0.5).requires_grad_(True)
    grad_out = ctx.randn(slots, inner, gen=gen, dtype=BF16)
    rows64, stack64 = to_cpu64(rows.requires_grad_(True), stack)
    rows = rows.detach()
    out64 = grouped_mm_reference(rows64, stack64.transpose(1, 2), ends.cpu())
    out64.backward(grad_out.to("cpu", F64))
    gemm = te_kernels.TELinearFactory(te, ctx.device, fp8_rows=te_kernels.FP8_GROUP_ROWS.get(recipe, 16)
                                      ).grouped(groups, latent, inner)

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
    return Row(name, verdict(rel_y, tol_y, math.isfinite(rel_grad) and rel_grad <= tol_grad), max_abs, rel_y, tol_y,
               ref_ms, fast_ms, f"E={groups} l={latent} I={inner} slots={slots} fwd+bwd, gradients into the stack; "
               f"grads rel {rel_grad:.2e} (worst {worst}, tol {tol_grad:.0e})")


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
    return Row("transformer_engine fp8 state", "PASS" if ok else "FAIL", note=(
        f"extra state: {type(extra).__name__} of {getattr(extra, 'numel', lambda: 0)()} fp32 values; outputs "
        f"bit-identical after loading: {same_out}; state identical: {same_state}"))


# ---------------------------------------------------------------------------------------------
# 8. recipes/k3-1gpu.yaml: 50 steps in bf16 and in fp8, and the throughput table


class DeviceInitModel(K3Model):
    """K3Model initialised on its own device with the rules of `K3Model.init_weights` (norms 1,
    AttnRes queries 0, convolutions uniform, KDA gates from their streams, the rest normal), from a
    device generator: seconds instead of a minute of CPU draws for 6B parameters. Timing runs only:
    the values are not the seeded layout-independent ones."""

    def init_weights(self, seed: int, tile_elements: int = 0) -> None:
        params = list(self.named_parameters())
        if not params or params[0][1].is_meta:
            return
        gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
        with torch.no_grad():
            for name, param in params:
                if name.endswith(("A_log", "dt_bias")):
                    continue
                if name.endswith("_res.proj.weight"):
                    param.zero_()
                elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    param.fill_(1.0)
                elif name.endswith("conv1d.weight"):
                    bound = 1.0 / math.sqrt(param.shape[-1])
                    param.uniform_(-bound, bound, generator=gen)
                else:
                    param.normal_(0.0, self.config.init_std, generator=gen)
        for name, module in self.named_modules():
            if hasattr(module, "reset_gate_parameters"):
                module.reset_gate_parameters(seed, name)


@dataclasses.dataclass
class TrainRun:
    precision: str
    attn_res: str
    backend: str
    losses: list[float]
    step_ms: float
    tokens_per_step: int
    flops_per_token: float
    peak_gib: Optional[float]  # CUDA allocator peak; None on the CPU
    micro_batch: int

    def table_row(self, peak_tflops: float) -> dict:
        tokens_per_s = self.tokens_per_step / self.step_ms * 1e3
        tflops = tokens_per_s * self.flops_per_token / 1e12
        return {"precision": self.precision, "attn_res": self.attn_res, "linear_backend": self.backend,
                "micro_batch": self.micro_batch, "step_ms": round(self.step_ms, 2),
                "tokens_per_s": round(tokens_per_s), "tflops": round(tflops, 1), "mfu": round(tflops / peak_tflops, 4),
                "peak_memory_gib": None if self.peak_gib is None else round(self.peak_gib, 2)}


def k3_1gpu_config(ctx: Context):
    """recipes/k3-1gpu.yaml on CUDA (fewer layers with --quick); a tiny K3-shaped stand-in on the CPU."""
    job = load_config(str(CHECKOUT / "recipes" / "k3-1gpu.yaml"))
    if ctx.cuda and not ctx.quick:
        return job
    model = job.model.replace(hidden_size=64, num_hidden_layers=4, num_attention_heads=2, q_lora_rank=32,
                              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                              linear_attn_config=dataclasses.replace(job.model.linear_attn_config, num_heads=2, head_dim=16),
                              intermediate_size=128, num_experts=8, num_experts_per_token=2,
                              moe_intermediate_size=32, routed_expert_hidden_size=32, attn_res_block_size=2,
                              vocab_size=512)
    if ctx.cuda:  # --quick on a GPU: the recipe's widths, 8 layers
        model = job.model.replace(num_hidden_layers=8, attn_res_block_size=2)
    return dataclasses.replace(job, model=model, data=dataclasses.replace(job.data, seq_length=ctx.pick(4096, 64)),
                               train=dataclasses.replace(job.train, micro_batch_size=ctx.pick(2, 2)))


def markov_batches(vocab: int, steps: int, batch: int, seq: int, device: torch.device
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable tokens, one (tokens, labels) batch per step: walks on a fixed random chain over
    min(vocab, 4096) tokens where each token is followed by one of 4 successors (loss floor
    ln 4 ≈ 1.39). All walks advance together, one position at a time."""
    states = min(vocab, 4096)
    gen = torch.Generator().manual_seed(7)
    table = torch.randint(0, states, (states, 4), generator=gen)
    choices = torch.randint(0, 4, (steps * batch, seq + 1), generator=gen)
    tokens = torch.empty(steps * batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, states, (steps * batch,), generator=gen)
    for t in range(1, seq + 1):
        tokens[:, t] = table[tokens[:, t - 1], choices[:, t]]
    tokens = tokens.to(device).view(steps, batch, seq + 1)
    return [(tokens[step, :, :-1], tokens[step, :, 1:]) for step in range(steps)]


def train_k3_1gpu(ctx: Context, job, precision: str, attn_res: str, steps: int, batches: list) -> TrainRun:
    """`steps` optimizer steps of one micro-batch each (Per-Head Muon, the recipe's optimizer, constant
    lr), the forward under training.build's precision context; the step time is the median after
    warm-up (CUDA events), peak memory the allocator's."""
    job = dataclasses.replace(job, model=job.model.replace(attn_res=attn_res),
                              train=dataclasses.replace(job.train, precision=precision))
    model_config = job.model
    backend = te_kernels.resolve_linear_backend("te" if precision == "fp8" else model_config.linear_backend, ctx.device)
    factory = te_kernels.linear_factory_for(backend, ctx.device, job.train.fp8_recipe)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with torch.device(ctx.device):
        model = DeviceInitModel(model_config, seed=0, linear_factory=factory)
    if backend == "te":
        te_kernels.keep_modules_out_of_fp8([model.layers[str(i)] for i in fp8_excluded_layers(model_config, None)])
    optimizer = build_optimizer(model, job.optimizer)
    context = forward_precision_context(job, ctx.device)
    losses, times = [], []
    for step in range(steps):
        tokens, labels = batches[step]
        start = time.perf_counter()
        if ctx.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        optimizer.zero_grad(set_to_none=True)
        with context():
            logits = model(tokens)
        loss = model.loss(logits, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.optimizer.clip_grad)
        optimizer.step()
        model.update_routing_biases()
        losses.append(loss.detach())
        if ctx.cuda:
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            times.append(1e3 * (time.perf_counter() - start))
    warm = times[min(5, len(times) - 1):]
    tokens_per_step = batches[0][0].numel()
    peak = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.cuda else None
    run = TrainRun(precision, attn_res, backend, [float(x) for x in losses], statistics.median(warm), tokens_per_step,
                   training_flops_per_token(model_config, tokens.shape[1]).total, peak, tokens.shape[0])
    del model, optimizer, logits, loss
    return run


def gpu_peak_tflops(ctx: Context) -> tuple[float, str]:
    """The GPU's dense bf16 peak: its tools/hardware profile (H100/H200/B200/GB200), else the
    throughput table; on a CPU the measured fp32 matmul rate."""
    if ctx.cuda:
        name = torch.cuda.get_device_name(ctx.device)
        for profile in ("gb200", "b200", "h200", "h100"):
            if profile.upper() in name.upper().replace(" ", ""):
                return load_profile(profile).bf16_tflops, f"tools/hardware/{profile}.yaml"
    peak = peak_flops(ctx.device)
    return peak.tflops, peak.label


def compare_loss_curves(reference: list[float], other: list[float], tail: int = 10) -> tuple[float, float]:
    """(max over all steps, mean over the last `tail` steps) of |other − reference| / reference."""
    rel = [abs(b - a) / abs(a) if a else math.inf for a, b in zip(reference, other)]
    if len(reference) != len(other) or not rel:
        return math.inf, math.inf
    return max(rel), statistics.fmean(rel[-tail:])


def check_k3_1gpu(ctx: Context) -> Iterator[Row]:
    """recipes/k3-1gpu.yaml (every K3 feature, ~1.1B active, sized for a 141 GB H200) trained 50
    steps from the same weights and batches in bf16 and in fp8 (Transformer Engine, the recipe's
    FP8 recipe, first and last layers bf16): both loss curves finite, fp8 within the stated
    tolerance of bf16 over the last 10 steps (`k3_1gpu_loss_fp8`: 3e-2 relative); then tokens/s,
    TFLOP/s, MFU (model FLOPs against the GPU's dense bf16 peak) and peak memory for bf16 and fp8,
    with Block AttnRes and without (plain residuals, to show AttnRes's overhead). On the CPU a
    tiny stand-in runs the bf16 path (fp8 rows SKIP). The table also goes into --json."""
    job = k3_1gpu_config(ctx)
    te, why = te_unavailable_reason(ctx)
    steps, timing_steps = (50, 15) if ctx.cuda and not ctx.quick else (10, 6) if ctx.cuda else (4, 3)
    seq = job.data.seq_length
    peak_tflops, peak_source = gpu_peak_tflops(ctx)
    precisions = ["bf16", "fp8"] if te is not None else ["bf16"]
    # The recipe's micro-batch first; if any run runs out of memory, every run again at 1 (the
    # bf16 and fp8 curves must see the same batches).
    for batch in dict.fromkeys([job.train.micro_batch_size, 1]):
        batches = markov_batches(job.model.vocab_size, steps, batch, seq, ctx.device)
        runs: dict[tuple[str, str], TrainRun] = {}
        failures: list[Row] = []
        out_of_memory = False
        for attn_res in ("block", "none"):
            for precision in precisions:
                name = f"k3_1gpu {precision} attn_res={attn_res}"
                try:
                    runs[(precision, attn_res)] = train_k3_1gpu(
                        ctx, job, precision, attn_res, steps if attn_res == "block" else timing_steps, batches)
                except torch.cuda.OutOfMemoryError as exc:
                    out_of_memory = True
                    failures.append(Row(name, "FAIL", note=f"out of memory at micro-batch {batch} x {seq}: {describe(exc)}"))
                except Exception as exc:  # noqa: BLE001 - a row, the run goes on
                    traceback.print_exc(file=sys.stderr)
                    failures.append(Row(name, "FAIL", note=describe(exc)))
                finally:
                    release(ctx)
                if out_of_memory:
                    break
            if out_of_memory:
                break
        if not out_of_memory or batch == 1:
            break
        print(f"  k3_1gpu: out of memory at micro-batch {batch} x {seq}; every run again at 1", flush=True)
    yield from failures
    if ("bf16", "block") in runs and ("fp8", "block") in runs:
        bf16, fp8 = runs[("bf16", "block")].losses, runs[("fp8", "block")].losses
        worst, tail = compare_loss_curves(bf16, fp8)
        finite = all(math.isfinite(x) for x in bf16 + fp8)
        tol = TOL["k3_1gpu_loss_fp8"]
        yield Row("k3_1gpu loss fp8-vs-bf16", verdict(tail, tol, finite), None, tail, tol, None, None,
                  f"{len(bf16)} steps, B={batch} T={seq}; loss bf16 {bf16[0]:.3f} -> {bf16[-1]:.3f}, fp8 "
                  f"{fp8[0]:.3f} -> {fp8[-1]:.3f}; rel diff mean of last 10 {tail:.2e}, max {worst:.2e} (not gated)")
    else:
        yield skip("k3_1gpu loss fp8-vs-bf16", why or "a training run failed")
    table = []
    for attn_res in ("block", "none"):
        for precision in ("bf16", "fp8"):
            run = runs.get((precision, attn_res))
            name = f"k3_1gpu speed {precision} attn_res={attn_res}"
            if run is None:
                if precision == "fp8" and te is None:
                    yield skip(name, why)
                continue
            row = run.table_row(peak_tflops)
            table.append(row)
            finite = all(math.isfinite(x) for x in run.losses)
            plain = runs.get((precision, "none"))
            overhead = (f"; AttnRes overhead {run.step_ms / plain.step_ms:.3f}x" if attn_res == "block" and plain else "")
            yield Row(name, "PASS" if finite else "FAIL", None, None, None, None, run.step_ms,
                      f"{row['tokens_per_s']:,} tok/s, {row['tflops']} TFLOP/s, MFU {row['mfu']:.1%} (peak "
                      f"{peak_tflops:g} TFLOP/s bf16, {peak_source}), peak {row['peak_memory_gib']} GiB, "
                      f"{run.backend} linears, B={run.micro_batch} T={seq}{overhead}")
    ctx.results["k3_1gpu"] = {
        "recipe": "recipes/k3-1gpu.yaml" if ctx.cuda and not ctx.quick else "k3-1gpu stand-in (small)",
        "peak_bf16_tflops": peak_tflops, "peak_source": peak_source, "throughput": table,
        "loss_curves": {f"{p}/{a}": run.losses for (p, a), run in runs.items()},
        "loss_tolerance": TOL["k3_1gpu_loss_fp8"],
    }
    print_throughput_table(table)


def print_throughput_table(table: list[dict]) -> None:
    if not table:
        return
    keys = ["precision", "attn_res", "linear_backend", "micro_batch", "step_ms", "tokens_per_s", "tflops", "mfu",
            "peak_memory_gib"]
    print("  | " + " | ".join(keys) + " |")
    print("  |" + "---|" * len(keys))
    for row in table:
        print("  | " + " | ".join(f"{row[k]:.1%}" if k == "mfu" else str(row[k]) for k in keys) + " |")


# ---------------------------------------------------------------------------------------------
# Registry and driver


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], Iterator[Row]]


CHECKS: list[Check] = [
    Check("kda_chunk", check_kda_chunk),
    Check("kda_fla", check_kda_fla),
    Check("kda_speed", check_kda_speed),
    Check("grouped_mm", check_grouped_mm),
    Check("grouped_mm_speed", check_grouped_mm_speed),
    Check("attn_res", check_attn_res),
    Check("situ_glu", check_situ_glu),
    Check("fused_paths", check_fused_paths),
    Check("newton_schulz", check_newton_schulz),
    Check("model_debug", check_model_debug),
    Check("model_large", check_model_large),
    Check("expert_dispatch", check_expert_dispatch),
    Check("transformer_engine", check_transformer_engine),
    Check("k3_1gpu", check_k3_1gpu),
]


def release(ctx: Context) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def guarded(ctx: Context, name: str, make_row: Callable[[], Row]) -> Row:
    """`make_row()`, or a FAIL row naming the exception (traceback on stderr), so that one broken
    case (an unsupported dtype, out of memory) does not hide the cases after it."""
    try:
        return make_row()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row, the run goes on
        traceback.print_exc(file=sys.stderr)
        return Row(name, "FAIL", note=describe(exc))
    finally:
        release(ctx)


def describe(exc: BaseException) -> str:
    first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}"


def run_check(ctx: Context, check: Check) -> list[Row]:
    """The check's rows; an exception becomes a FAIL row (traceback on stderr) after any rows it
    already produced."""
    rows: list[Row] = []
    start = time.perf_counter()
    try:
        for row in check.run(ctx):
            rows.append(row)
            print(f"  {format_row(row)}", flush=True)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row, the run goes on
        traceback.print_exc(file=sys.stderr)
        rows.append(Row(check.name, "FAIL", note=describe(exc)))
        print(f"  {format_row(rows[-1])}", flush=True)
    release(ctx)
    print(f"  ({check.name}: {time.perf_counter() - start:.1f} s)", flush=True)
    return rows


def fmt(value: Optional[float], spec: str) -> str:
    if value is None:
        return "-"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return format(value, spec)


HEADER = ["check", "max abs", "rel err", "tol", "status", "ref ms", "fast ms", "speed-up", "note"]


def row_cells(row: Row) -> list[str]:
    return [row.name, fmt(row.max_abs, ".2e"), fmt(row.rel, ".2e"), fmt(row.tol, ".0e"), row.status,
            fmt(row.ref_ms, ".3f"), fmt(row.fast_ms, ".3f"),
            "-" if row.speedup is None else f"{row.speedup:.2f}x", row.note]


def format_row(row: Row) -> str:
    return " | ".join(row_cells(row))


def print_table(rows: list[Row]) -> None:
    cells = [HEADER] + [row_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER) - 1)]
    for index, line in enumerate(cells):
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        print("| " + " | ".join(padded + [line[-1]]) + " |")
        if index == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|------|")


def environment(ctx: Context) -> str:
    parts = [f"torch {torch.__version__}", f"device {ctx.device}"]
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        parts += [f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)",
                  f"triton {package_version('triton', 'triton')}", f"fla-core {package_version('fla', 'fla-core')}",
                  f"transformer-engine {package_version('transformer_engine', 'transformer-engine')}"]
    parts.append("quick" if ctx.quick else "full sizes" if ctx.cuda else "small sizes (CPU)")
    return ", ".join(parts)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    names = [check.name for check in CHECKS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="checks: " + ", ".join(names))
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--only", action="append", choices=names, metavar="NAME",
                        help="run only this check (repeatable): " + ", ".join(names))
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (use --device cpu)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    ctx = Context(torch.device(args.device), args.quick)
    if not ctx.cuda:
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    print(f"gpu_check: {environment(ctx)}", flush=True)
    selected = [c for c in CHECKS if args.only is None or c.name in args.only]
    rows: list[Row] = []
    start = time.perf_counter()
    for check in selected:
        print(f"[{check.name}]", flush=True)
        rows.extend(run_check(ctx, check))
    failed = [r.name for r in rows if r.status == "FAIL"]
    print(f"\ngpu_check: {environment(ctx)}; {time.perf_counter() - start:.0f} s")
    print_table(rows)
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu_check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP"
          + (f": FAILED {', '.join(failed)}" if failed else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"environment": environment(ctx), "rows": [dataclasses.asdict(r) for r in rows], **ctx.results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
