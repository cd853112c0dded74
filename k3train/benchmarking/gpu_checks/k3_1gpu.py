"""recipes/k3-1gpu.yaml on one GPU: 50 training steps in bf16 and in fp8 from the same weights
and batches, the loss curves compared, and the throughput table (tokens/s, TFLOP/s, MFU, peak
memory) with Block AttnRes and without."""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

from k3train.config import load_config
from k3train.kernels import te as te_kernels
from k3train.model.flops import training_flops_per_token
from k3train.model.k3 import K3ModelChunk
from k3train.optim.builder import build_optimizer
from k3train.planning.hardware import load_profile
from k3train.training.build import forward_precision_context, fp8_excluded_layers
from k3train.training.throughput import peak_flops

from . import transformer_engine as te_checks
from .common import TOL, Context, Row, describe, release, skip, verdict

CHECKOUT = Path(__file__).resolve().parents[3]  # k3train/benchmarking/gpu_checks/ → the checkout


class DeviceInitModel(K3ModelChunk):
    """K3ModelChunk initialised on its own device with the rules of `K3ModelChunk.init_weights` (norms 1,
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
    """One training run's losses and its timings: `model_ms` (forward and backward of one
    micro-batch) and `optimizer_ms` (clipping, the optimizer step, the routing biases), each the
    median over the steps after warm-up, as training's step line reports them apart."""

    precision: str
    attn_res: str
    backend: str
    losses: list[float]
    model_ms: float
    optimizer_ms: float
    timed_steps: int
    tokens_per_micro_batch: int
    flops_per_token: float
    peak_gib: float | None  # CUDA allocator peak; None on the CPU
    micro_batch: int
    micro_batches: int  # the recipe's per step on one GPU (global batch / micro-batch)

    @property
    def step_ms(self) -> float:
        """A recipe step: `micro_batches` forward-backward passes, then one optimizer step."""
        return self.micro_batches * self.model_ms + self.optimizer_ms

    def table_row(self, peak_tflops: float) -> dict:
        model_tflops = self.tokens_per_micro_batch * self.flops_per_token / self.model_ms / 1e9
        step_tokens = self.micro_batches * self.tokens_per_micro_batch
        step_tflops = step_tokens * self.flops_per_token / self.step_ms / 1e9
        return {
            "precision": self.precision,
            "attn_res": self.attn_res,
            "linear_backend": self.backend,
            "micro_batch": self.micro_batch,
            "micro_batches": self.micro_batches,
            "timed_steps": self.timed_steps,
            "model_ms": round(self.model_ms, 2),
            "optimizer_ms": round(self.optimizer_ms, 2),
            "step_ms": round(self.step_ms, 2),
            "tokens_per_s": round(step_tokens / self.step_ms * 1e3),
            "model_tflops": round(model_tflops, 1),
            "model_mfu": round(model_tflops / peak_tflops, 4),
            "optimizer_share": round(self.optimizer_ms / self.step_ms, 4),
            "mfu": round(step_tflops / peak_tflops, 4),
            "peak_memory_gib": None if self.peak_gib is None else round(self.peak_gib, 2),
        }


def warm_median(times: list[float], warmup: int) -> tuple[float, int]:
    """The median of `times` after the first `warmup` (at least 3 timed where there are 4 or
    more: compilation and autotuning land in the first calls), and how many were timed."""
    skip = max(0, min(warmup, len(times) - 3))
    timed = times[skip:]
    return statistics.median(timed), len(timed)


def k3_1gpu_config(ctx: Context):
    """recipes/k3-1gpu.yaml on CUDA (fewer layers with --quick); a tiny K3-shaped stand-in on the CPU."""
    job = load_config(str(CHECKOUT / "recipes" / "k3-1gpu.yaml"))
    if ctx.cuda and not ctx.quick:
        return job
    model = job.model.replace(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        linear_attn_config=dataclasses.replace(job.model.linear_attn_config, num_heads=2, head_dim=16),
        intermediate_size=128,
        num_experts=8,
        num_experts_per_token=2,
        moe_intermediate_size=32,
        routed_expert_hidden_size=32,
        attn_res_block_size=2,
        vocab_size=512,
    )
    if ctx.cuda:  # --quick on a GPU: the recipe's widths, 8 layers
        model = job.model.replace(num_hidden_layers=8, attn_res_block_size=2)
    return dataclasses.replace(
        job,
        model=model,
        data=dataclasses.replace(job.data, seq_length=ctx.pick(4096, 64)),
        train=dataclasses.replace(job.train, micro_batch_size=ctx.pick(2, 2)),
    )


def markov_batches(
    vocab: int, steps: int, batch: int, seq: int, device: torch.device
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


WARMUP_STEPS = 5
"""Steps left out of the CUDA medians: allocator growth, autotuning, TE's first FP8 amax."""


class StepMarks:
    """Two intervals of one step, forward-backward then optimizer: CUDA events on the GPU (one
    synchronisation at the end), a host clock on the CPU."""

    def __init__(self, ctx: Context):
        self.cuda = ctx.cuda
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            self.events[0].record()
        else:
            self.times = [time.perf_counter()]

    def mark(self) -> None:
        if self.cuda:
            self.events[1].record()
        else:
            self.times.append(time.perf_counter())

    def finish(self) -> tuple[float, float]:
        if self.cuda:
            self.events[2].record()
            self.events[2].synchronize()
            return self.events[0].elapsed_time(self.events[1]), self.events[1].elapsed_time(self.events[2])
        self.times.append(time.perf_counter())
        return 1e3 * (self.times[1] - self.times[0]), 1e3 * (self.times[2] - self.times[1])


def recipe_micro_batches(job) -> int:
    """Micro-batches per optimizer step of the recipe on one GPU: global batch / micro-batch."""
    return max(1, job.train.global_batch_size // job.train.micro_batch_size)


def train_k3_1gpu(ctx: Context, job, precision: str, attn_res: str, steps: int, batches: list) -> TrainRun:
    """`steps` optimizer steps of one micro-batch each (Per-Head Muon, the recipe's optimizer, constant
    lr), the forward under training.build's precision context. The forward-backward and the
    optimizer are timed apart (medians after warm-up, CUDA events): a recipe step is
    `micro_batches` of the first and one of the second, so timing one micro-batch with a whole
    optimizer step would read the model several times slower than training runs it. Peak memory
    is the allocator's."""
    job = dataclasses.replace(
        job, model=job.model.replace(attn_res=attn_res), train=dataclasses.replace(job.train, precision=precision)
    )
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
    losses: list[torch.Tensor] = []
    model_times, optimizer_times = [], []
    for step in range(steps):
        tokens, labels = batches[step]
        marks = StepMarks(ctx)
        optimizer.zero_grad(set_to_none=True)
        with context():
            logits = model(tokens)
        loss = model.loss(logits, labels)
        loss.backward()
        marks.mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.optimizer.clip_grad)
        optimizer.step()
        te_kernels.new_fp8_weights([model])  # as training: the next forward casts the new weights
        model.update_routing_biases()
        losses.append(loss.detach())
        model_ms, optimizer_ms = marks.finish()
        model_times.append(model_ms)
        optimizer_times.append(optimizer_ms)
    warmup = WARMUP_STEPS if ctx.cuda else 1
    model_median, timed = warm_median(model_times, warmup)
    optimizer_median, _ = warm_median(optimizer_times, warmup)
    peak = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.cuda else None
    run = TrainRun(
        precision,
        attn_res,
        backend,
        [float(x) for x in losses],
        model_median,
        optimizer_median,
        timed,
        batches[0][0].numel(),
        training_flops_per_token(model_config, tokens.shape[1]).total,
        peak,
        tokens.shape[0],
        recipe_micro_batches(job),
    )
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
    tolerance of bf16 over the last 10 steps (`k3_1gpu_loss_fp8`: 3e-2 relative); then, for bf16
    and fp8, with Block AttnRes and without (plain residuals, to show AttnRes's overhead): the
    forward-backward of one micro-batch and the optimizer step timed apart (medians after
    warm-up), model MFU (model FLOPs of the forward-backward against the GPU's dense bf16 peak),
    the optimizer's time, and the recipe's whole step from them (its micro-batches per step of
    forward-backward, one optimizer step: tokens/s and MFU as training's step line reports them;
    Newton–Schulz FLOPs are not model FLOPs), and peak memory. On the CPU a
    tiny stand-in runs the bf16 path (fp8 rows SKIP). The table also goes into --json."""
    job = k3_1gpu_config(ctx)
    te, why = te_checks.te_unavailable_reason(ctx)
    steps, timing_steps = (50, 15) if ctx.cuda and not ctx.quick else (10, 6) if ctx.cuda else (5, 4)
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
                        ctx, job, precision, attn_res, steps if attn_res == "block" else timing_steps, batches
                    )
                except torch.cuda.OutOfMemoryError as exc:
                    out_of_memory = True
                    failures.append(
                        Row(name, "FAIL", note=f"out of memory at micro-batch {batch} x {seq}: {describe(exc)}")
                    )
                except Exception as exc:
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
        yield Row(
            "k3_1gpu loss fp8-vs-bf16",
            verdict(tail, tol, finite),
            None,
            tail,
            tol,
            None,
            None,
            f"{len(bf16)} steps, B={batch} T={seq}; loss bf16 {bf16[0]:.3f} -> {bf16[-1]:.3f}, fp8 "
            f"{fp8[0]:.3f} -> {fp8[-1]:.3f}; rel diff mean of last 10 {tail:.2e}, max {worst:.2e} (not gated)",
        )
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
            overhead = (
                f"; AttnRes overhead {run.model_ms / plain.model_ms:.3f}x (forward-backward medians)"
                if attn_res == "block" and plain
                else ""
            )
            yield Row(
                name,
                "PASS" if finite else "FAIL",
                None,
                None,
                None,
                None,
                run.step_ms,
                f"recipe step of {run.micro_batches} micro-batches of B={run.micro_batch} T={seq}: "
                f"{row['tokens_per_s']:,} tok/s, MFU {row['mfu']:.1%}; model (fwd+bwd) {row['model_ms']} ms, "
                f"{row['model_tflops']} TFLOP/s, model MFU {row['model_mfu']:.1%}; optimizer {row['optimizer_ms']} ms "
                f"({row['optimizer_share']:.1%} of the step); medians of {run.timed_steps} steps after warm-up "
                f"(peak {peak_tflops:g} TFLOP/s bf16, {peak_source}), peak {row['peak_memory_gib']} GiB, "
                f"{run.backend} linears{overhead}",
            )
    ctx.results["k3_1gpu"] = {
        "recipe": "recipes/k3-1gpu.yaml" if ctx.cuda and not ctx.quick else "k3-1gpu stand-in (small)",
        "peak_bf16_tflops": peak_tflops,
        "peak_source": peak_source,
        "throughput": table,
        "loss_curves": {f"{p}/{a}": run.losses for (p, a), run in runs.items()},
        "loss_tolerance": TOL["k3_1gpu_loss_fp8"],
    }
    print_throughput_table(table)


def print_throughput_table(table: list[dict]) -> None:
    if not table:
        return
    keys = [
        "precision",
        "attn_res",
        "linear_backend",
        "micro_batch",
        "micro_batches",
        "model_ms",
        "optimizer_ms",
        "step_ms",
        "tokens_per_s",
        "model_tflops",
        "model_mfu",
        "mfu",
        "peak_memory_gib",
    ]
    print("  | " + " | ".join(keys) + " |")
    print("  |" + "---|" * len(keys))
    for row in table:
        print("  | " + " | ".join(f"{row[k]:.1%}" if k in ("mfu", "model_mfu") else str(row[k]) for k in keys) + " |")
