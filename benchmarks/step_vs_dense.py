"""k3train's training step against a plain dense transformer of the same FLOPs per token.

For the debug recipe and a 512-wide K3-shaped model (hidden 512, 4 layers, 2,048 tokens per
step), in one process and with steps alternated (a busy machine slows every contender alike):

- k3train's real step (`k3train.training.build.build_rank` + `Trainer.train_step`: pipeline
  schedule with gradient accumulation, clipping, optimizer, balancer update) with Per-Head Muon,
  with AdamW, and, with `--compile`, with `train.compile=true` (every region, and the AttnRes
  mixes alone: `train.compile_regions=[attn_res]`);
- a dense peer written here (pre-norm, causal SDPA, SwiGLU, untied head, AdamW through the same
  kernel as k3train's (`optimizer.adamw_fused`), the same micro-batching and clipping) whose
  width and MLP size are solved so that its training FLOPs per token (`dense_flops_per_token`,
  the same conventions as `k3train/model/flops.py`: matmuls only,
  causal attention counted as its half, training = 3 × forward) equal k3train's.

Every contender first takes `--warmup` untimed steps (default 10): in bf16, k3train's mix of
bf16 and fp32 buffers of many sizes fragments glibc's heap, which keeps growing for about ten
steps; each growth is fresh memory whose first touch page-faults (a few µs per 4 KiB page), so
right after one warm-up step its steps took 15-20% longer than in a long run. The table prints
the minor page faults of each timed step, so a reader can see the allocator had settled.

It prints each contender's median step time, model FLOP/s over the measured fp32 matmul rate of
this machine (`measure_cpu_matmul_tflops`, median of trials) and, on a CPU, its bf16/fp32 matmul
rate ratio (runs on CPUs with and without bf16 matrix units read side by side), tokens/s against the dense peer,
the aten operations of one step (counted by a dispatch mode on one more, untimed step: those that
run a kernel, about one launch each on a GPU, and views),
and, for the Muon step, Newton–Schulz's GFLOP and time (optimizer FLOPs, outside MFU). Then one
profiled k3train step (Per-Head Muon) attributed to parts: `torch.profiler` ranges opened by
forward hooks on the model's modules (and around the KDA kernel, the grouped GEMMs and the
optimizer step); a backward op goes to the part of the forward op that made its autograd node
(matched by sequence number); what no range covers (Python, the autograd engine, the loss,
norms, embedding, head, clipping) is "other".

On a GPU (`--device cuda`, normally with `--precision bf16`) the same comparison runs there:
both contenders in bf16 autocast over fp32 weights, KDA on fla's kernel when fla-core imports,
step times over `torch.cuda.synchronize`, the matmul rate that of a large GEMM in the compute
dtype, and the profiled parts in device (kernel) time, the rest of the wall time being what the
GPU waited for the host ("other"). `--override KEY=VALUE` changes both contenders' recipe (the
dense peer is re-sized to the new FLOPs per token), e.g. a larger batch for a GPU.

    OMP_NUM_THREADS=1 nice python benchmarks/step_vs_dense.py                    # both models, ~6 min
    OMP_NUM_THREADS=1 nice python benchmarks/step_vs_dense.py --models debug --steps 3
    python benchmarks/step_vs_dense.py --device cuda --precision bf16 --models wide512 --steps 10 \
        --override train.global_batch_size=32 --override train.micro_batch_size=8
"""

from __future__ import annotations

import argparse

import torch

from k3train.benchmarking.step_comparison import MODELS, compare, measure_matmul_tflops
from k3train.training.throughput import measure_cpu_matmul_tflops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["debug", "wide512"])
    parser.add_argument("--steps", type=int, default=3, help="measured steps per contender (after --warmup rounds)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="untimed alternated rounds first (default 10): the first compiles; in bf16 k3train's "
        "heap keeps growing for about ten steps, each faulting fresh pages a long run does not",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time train.compile=true (AdamW): every region, and compile_regions=[attn_res]",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="train.precision of both contenders (bf16: autocast over fp32 weights)",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override for both contenders (repeatable), e.g. train.micro_batch_size=8",
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device)
    if device.type == "cpu":
        peak = measure_cpu_matmul_tflops()
        print(f"threads {torch.get_num_threads()}; fp32 matmul rate {1e3 * peak:.1f} GFLOP/s (median of 7 trials)")
    else:
        peak = measure_matmul_tflops(device, args.precision)
        print(f"{torch.cuda.get_device_name(device)}; {args.precision} 8192² GEMM rate {peak:.0f} TFLOP/s")
    for name in args.models:
        compare(
            name,
            MODELS[name] + args.override,
            args.steps,
            peak,
            args.compile,
            not args.no_profile,
            device,
            args.precision,
            warmup=args.warmup,
        )


if __name__ == "__main__":
    main()
