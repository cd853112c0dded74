"""What every check of tools/gpu_check.py shares: the run's `Context` (device, sizes, seeded
inputs, timing), the table's `Row`, the error measures (`error`, `compare`, `verdict`), the
tolerances `TOL`, and `guarded`, which turns a failing case into a FAIL row."""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

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


@dataclasses.dataclass
class Row:
    name: str
    status: str  # PASS, FAIL or SKIP
    max_abs: float | None = None
    rel: float | None = None
    tol: float | None = None
    ref_ms: float | None = None
    fast_ms: float | None = None
    note: str = ""

    @property
    def speedup(self) -> float | None:
        if self.ref_ms is None or self.fast_ms is None or self.fast_ms <= 0:
            return None
        return self.ref_ms / self.fast_ms


def skip(name: str, reason: str, ref_ms: float | None = None) -> Row:
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

    def time_ms(self, fn: Callable[[], object], reps: int | None = None, warmup: int | None = None) -> float:
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


def release(ctx: Context) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def guarded(ctx: Context, name: str, make_row: Callable[[], Row]) -> Row:
    """`make_row()`, or a FAIL row naming the exception (traceback on stderr), so that one broken
    case (an unsupported dtype, out of memory) does not hide the cases after it."""
    try:
        return make_row()
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        return Row(name, "FAIL", note=describe(exc))
    finally:
        release(ctx)


def describe(exc: BaseException) -> str:
    first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}"
