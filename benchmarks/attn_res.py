"""What Attention Residuals cost a training step: `attn_res` block / full against none, on CPU.

One model per mode (same recipe, same seed, AdamW, `--micro-batches` forward+backward per
step), built in one process and stepped in alternation, so slow drifts of a shared machine hit
every mode alike; the table reports median step times and their ratio to `none`. Times are this
process's CPU seconds (`time.process_time`, one thread), which a loaded shared machine disturbs
far less than wall-clock time; `--wall` times wall-clock instead. Besides the ratio of medians the
table gives the median of each round's ratio (robust to load that drifts between rounds) and the
ratio of the fastest steps (closest to an unloaded machine). With
`--with-before`, two more models run `block` and `full` as commit 3c49d31 did (the stacked
reference mix, checkpointed together with the norm so that backward runs it twice), in the same
alternation.

    OMP_NUM_THREADS=1 nice python benchmarks/attn_res.py --model debug --repeats 5
    OMP_NUM_THREADS=1 nice python benchmarks/attn_res.py --model wide512 --repeats 3
    OMP_NUM_THREADS=1 nice python benchmarks/attn_res.py --model debug --repeats 5 --compile
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from k3train.benchmarking.step_comparison import WIDE_MODEL
from k3train.config import JobConfig
from k3train.config.recipe import load_recipe
from k3train.kernels.attn_res import attn_res_mix_reference
from k3train.model.attn_res import AttentionResidual
from k3train.model.k3 import K3ModelChunk
from k3train.training.compile import compile_elementwise

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml"


def stacked_checkpointed_input(
    self: AttentionResidual, sources: list[torch.Tensor], norm, inverse_norms=None, dots=None
) -> torch.Tensor:
    """`AttentionResidual.normalized_input` as of 3c49d31: stacked mix, checkpointed with the norm
    (every key normalised and scored in the mix: `inverse_norms` and `dots` are not read)."""
    if len(sources) == 1:
        return norm(sources[0])

    def mix_and_normalize(*inputs: torch.Tensor) -> torch.Tensor:
        return norm(attn_res_mix_reference(list(inputs), self.norm.weight, self.proj.weight[0], self.norm.eps))

    if self.recompute and torch.is_grad_enabled():
        return checkpoint(mix_and_normalize, *sources, use_reentrant=False)
    return mix_and_normalize(*sources)


def build(
    model_overrides: list[str], mode: str, compiled: bool = False
) -> tuple[K3ModelChunk, torch.optim.Optimizer, JobConfig]:
    """`mode`: an `attn_res` value, or `<value>@3c49d31` for the earlier mix. `compiled`: what
    `train.compile=true` compiles (`compile_elementwise`), the AttnRes mixes among it."""
    attn_res, _, before = mode.partition("@")
    config = load_recipe(JobConfig, str(RECIPE), model_overrides + [f"model.attn_res={attn_res}"])
    model = K3ModelChunk(config.model, seed=0)
    if compiled:
        compile_elementwise(model)
    if before:
        for module in model.modules():
            if isinstance(module, AttentionResidual):
                # Per-instance swap to the earlier mix, on purpose.
                module.normalized_input = types.MethodType(stacked_checkpointed_input, module)  # type: ignore[method-assign]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), config


def step(model: K3ModelChunk, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor], clock) -> float:
    start = clock()
    for tokens in batches:
        model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return clock() - start


def step_table(args: argparse.Namespace) -> None:
    overrides = WIDE_MODEL if args.model == "wide512" else []
    overrides = overrides + [f"model.recompute={args.recompute}"]
    modes = ["none", "block", "full"] + (["block@3c49d31", "full@3c49d31"] if args.with_before else [])
    runs = {mode: build(overrides, mode, args.compile) for mode in modes}
    config = runs["none"][2]
    generator = torch.Generator().manual_seed(0)
    micro = config.train.micro_batch_size
    batches = [
        torch.randint(0, config.model.vocab_size, (micro, config.data.seq_length + 1), generator=generator)
        for _ in range(config.train.global_batch_size // micro)
    ]
    clock = time.perf_counter if args.wall else time.process_time
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for model, optimizer, _ in runs.values():  # warm-up, not timed
        step(model, optimizer, batches, clock)
    for _ in range(args.repeats):
        for mode, (model, optimizer, _) in runs.items():
            times[mode].append(step(model, optimizer, batches, clock))
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    # Each round's ratio to that round's `none` step, then the median over rounds: a drift in the
    # machine's load between rounds cancels; the fastest round's steps show the unloaded cost.
    paired = {mode: statistics.median(t / base for t, base in zip(times[mode], times["none"])) for mode in times}
    fastest = {mode: min(t) for mode, t in times.items()}
    print(
        f"\n{args.model} model (hidden {config.model.hidden_size}, {config.model.num_hidden_layers} layers, "
        f"{config.train.global_batch_size * config.data.seq_length} tokens/step, recompute={args.recompute}, "
        f"block size {config.model.attn_res_block_size}{', train.compile=true' if args.compile else ''}), "
        f"{args.repeats} rounds, "
        f"{'wall-clock' if args.wall else 'process CPU'} seconds"
    )
    print(
        "| attn_res | median step (s) | / none | median of round ratios | fastest step (s) | / none |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: |"
    )
    for mode, seconds in medians.items():
        print(
            f"| {mode} | {seconds:.3f} | {seconds / medians['none']:.3f} | {paired[mode]:.3f} | "
            f"{fastest[mode]:.3f} | {fastest[mode] / fastest['none']:.3f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["debug", "wide512"], default="debug")
    parser.add_argument("--recompute", choices=["none", "attn_res", "sublayer"], default="attn_res")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wall", action="store_true", help="wall-clock instead of process CPU time")
    parser.add_argument("--with-before", action="store_true", help="also the 3c49d31 mix (see above)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="every model as train.compile=true runs it (the AttnRes mixes compiled; the warm-up compiles)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    step_table(args)


if __name__ == "__main__":
    main()
