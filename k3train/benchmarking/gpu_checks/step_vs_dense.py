"""k3train's whole training step against a dense transformer of equal FLOPs per token
(`benchmarks/step_vs_dense.py`): how much of the step the K3 machinery costs on this device."""

from __future__ import annotations

import math
from collections.abc import Iterator

from .common import Context, Row, guarded


def check_step_vs_dense(ctx: Context) -> Iterator[Row]:
    """Tokens/s of k3train's AdamW and Per-Head Muon steps over the dense peer's, steps alternated
    (the benchmark prints its tables above the rows). On CUDA the 512-wide K3-shaped model in bf16
    at 2,048 tokens per step and, at full size, 16,384, each with the parts of one profiled step
    in kernel time (what the GPU waits for the host shows as "other": how launch-bound the step
    is); on the CPU the debug model in fp32, one step each (the logic only). On CUDA without
    `--quick`, the 2,048-token case also times `train.compile=true` (every region: inductor's
    fused Triton kernels for the norms, activations and AttnRes mixes, the fused kernels the CPU
    lacks). PASS when every contender's loss is finite: the ratio is reported (`ref ms` the
    dense step, `fast ms` the AdamW step, `speed-up` their ratio, the 0.9× goal for
    AdamW), not gated."""
    from k3train.benchmarking.step_comparison import (
        ADAMW,
        COMPILED,
        COMPILED_ALL,
        DENSE,
        MODELS,
        MUON,
        compare,
        measure_matmul_tflops,
    )

    if ctx.cuda:
        precision, steps = "bf16", ctx.pick(8, 2)
        cases = [("wide512 2k tokens", MODELS["wide512"], not ctx.small)]
        if not ctx.small:
            cases.append(
                (
                    "wide512 16k tokens",
                    MODELS["wide512"] + ["train.global_batch_size=32", "train.micro_batch_size=8"],
                    False,
                )
            )
    else:
        precision, steps = "fp32", 1
        cases = [("debug", MODELS["debug"], False)]
    for label, overrides, with_compile in cases:
        name = f"step_vs_dense {label} {precision}"

        def row(
            label: str = label, overrides: list[str] = overrides, name: str = name, with_compile: bool = with_compile
        ) -> Row:
            peak = measure_matmul_tflops(ctx.device, precision)
            result = compare(
                label,
                overrides,
                steps,
                peak,
                with_compile=with_compile,
                profile=ctx.cuda,
                device=ctx.device,
                precision=precision,
                compiled=[COMPILED_ALL],
            )
            finite = all(math.isfinite(loss) for loss in result.final_losses.values())
            seconds = result.step_seconds
            compiled = "".join(
                f"; {contender.removeprefix('k3train, AdamW, ')}: {seconds[DENSE] / seconds[contender]:.2f}x"
                for contender in COMPILED
                if contender in seconds
            )
            return Row(
                name,
                "PASS" if finite else "FAIL",
                ref_ms=1e3 * seconds[DENSE],
                fast_ms=1e3 * seconds[ADAMW],
                note=f"{result.tokens} tokens/step; tokens/s vs the dense peer: AdamW "
                f"{result.adamw_vs_dense:.2f}x (target 0.9x){compiled}, Per-Head Muon "
                f"{seconds[DENSE] / seconds[MUON]:.2f}x; aten compute ops per step: AdamW "
                f"{result.operations[ADAMW][0]:,}, dense {result.operations[DENSE][0]:,}; "
                f"losses finite: {finite}",
            )

        yield guarded(ctx, name, row)
