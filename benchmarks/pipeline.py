"""Pipeline traffic of the AttnRes block protocols, and the measured pipeline bubble.

Part 1 (from the plan, no processes): block tensors one micro-batch's forward hops carry under the
naive full-history protocol, the paper's increments (arXiv 2603.15031 §4.1) and the exact delta,
for several `(P, V, layers, block size)`; each hop also carries the partial sum, and backward
sends the same again as gradients.

Part 2 (measured, gloo on CPU): P ranks run a small float32 K3 model through `PipelineExecutor`
with a fixed sleep added to every decoder layer (forward `t`, backward `2t`, through an autograd
function on the residual stream), so stage times are even and dominate the small real compute.
It prints the bytes comm.py counted on the pipeline hops beside the plan's exact count, and the
bubble: per rank, `1 − compute / step`, where `compute` is the time inside chunk forwards and
backwards (sleep + real work, from `time.perf_counter` stamps) and `step` runs from a barrier
before the step to a barrier after it; the mean over ranks and measured steps is shown beside
`(p−1)/(m+p−1)` (1F1B) or `(p−1)/(V·m+p−1)` (interleaved), and beside the simulated ideal order.

    OMP_NUM_THREADS=1 python benchmarks/pipeline.py                 # both parts (about a minute)
    OMP_NUM_THREADS=1 python benchmarks/pipeline.py --plan-only
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from k3train.parallel.pipeline_schedule import PROTOCOLS, PipelinePlan, bubble_formula, simulate

PLAN_SETTINGS = [  # (P, V, layers, block size)
    (2, 1, 8, 2),
    (2, 2, 8, 2),  # docs/design.md §2.1
    (2, 2, 8, 3),
    (4, 2, 8, 2),
    (4, 2, 16, 2),
    (4, 4, 16, 1),
    (8, 1, 93, 12),  # K3 full size: 93 layers, 8 blocks
    (8, 2, 93, 12),
    (4, 4, 96, 6),
    (8, 4, 96, 3),
]


def plan_table() -> str:
    rows = [
        f"{'P':>2} {'V':>2} {'layers':>6} {'S':>3} | {'naive':>6} {'paper':>6} {'exact':>6} | "
        f"{'exact/naive':>11} | tensors per micro-batch fwd (with partial sums) naive/paper/exact"
    ]
    for pp, v, layers, size in PLAN_SETTINGS:
        plan = PipelinePlan.build(layers, pp, v, "block", size)
        blocks = {p: plan.blocks_per_micro_batch(p) for p in PROTOCOLS}
        tensors = "/".join(str(plan.tensors_per_micro_batch(p)) for p in PROTOCOLS)
        ratio = blocks["exact"] / blocks["naive"] if blocks["naive"] else 1.0
        rows.append(
            f"{pp:>2} {v:>2} {layers:>6} {size:>3} | {blocks['naive']:>6} {blocks['paper']:>6} "
            f"{blocks['exact']:>6} | {ratio:>11.2f} | {tensors}"
        )
    return "\n".join(rows)


# ---------------------------------------------------------------------------- measured part
class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


def bench_worker(env, payload) -> list[dict]:
    """Runs every setting of `payload` on `env.world_size` = P ranks; returns per-setting stats."""
    import torch.distributed as dist

    from k3train.contracts.stage_io import ResidualState
    from k3train.model.config import ModelConfig
    from k3train.parallel.config import ModelSplitSizes
    from k3train.parallel.pipeline import PipelineExecutor, residual_shape
    from k3train.parallel.state import ParallelState, resolve_layout
    from k3train.training.build import build_model

    out = []
    layer_s = payload["layer_ms"] / 1000.0
    for pp, v, micro_batches, layers, size in payload["settings"]:
        config = ModelConfig(
            num_hidden_layers=layers,
            hidden_size=32,
            intermediate_size=64,
            num_experts=4,
            num_experts_per_token=2,
            moe_intermediate_size=16,
            routed_expert_hidden_size=16,
            attn_res_block_size=size,
        )
        layout = resolve_layout(env.world_size, 1, pp, 0, 1, v, ModelSplitSizes.of(config))
        state = ParallelState(layout, env.rank)
        plan = PipelinePlan.build(layers, pp, v, "block", size)
        chunks = build_model(config, plan, state, seed=1).chunks

        def sleepy(module, args):
            state_in = args[0]
            return (ResidualState(_Sleep.apply(state_in.partial, layer_s, 2 * layer_s), state_in.blocks),)

        for chunk in chunks:
            for layer in chunk.layers.values():
                layer.register_forward_pre_hook(sleepy)
        seq, mb = 16, 1
        tokens = torch.randint(
            0, config.vocab_size, (micro_batches * mb, seq + 1), generator=torch.Generator().manual_seed(0)
        )
        schedule = PipelineExecutor(plan, state.pp, residual_shape(mb, seq, config.hidden_size))
        bubbles, waits = [], []
        for repeat in range(payload["repeats"] + 1):
            state.counter.reset()
            dist.barrier()
            start = time.perf_counter()
            schedule.run(chunks, list(tokens.split(mb)))
            dist.barrier()
            step = time.perf_counter() - start
            if repeat:  # the first step warms up
                bubbles.append(1.0 - schedule.stats.compute_s / step)
                waits.append(schedule.stats.wait_s / step)
            for chunk in chunks:
                chunk.zero_grad(set_to_none=True)
        sent = state.counter.bytes.get("pp.forward", 0) + state.counter.bytes.get("pp.backward", 0)
        tensor_bytes = math.prod(residual_shape(mb, seq, config.hidden_size)) * 4
        out.append(
            {
                "setting": (pp, v, micro_batches, layers, size),
                "bubble": statistics.mean(bubbles),
                "recv_wait": statistics.mean(waits),
                "sent": sent,
                "expected": {p: plan.step_bytes(tensor_bytes, micro_batches, p) for p in PROTOCOLS},
            }
        )
    return out


def measured_table(layer_ms: float, repeats: int) -> str:
    from tests.distributed.harness import run_workers

    groups = {
        2: [(2, 1, 4, 8, 3), (2, 2, 4, 8, 3), (2, 2, 8, 8, 3)],
        4: [(4, 1, 8, 8, 3), (4, 2, 8, 8, 3), (4, 2, 4, 8, 2)],
    }
    rows = [
        f"{'P':>2} {'V':>2} {'M':>2} {'L':>2} {'S':>2} | {'bytes sent':>10} {'exact':>10} {'paper':>10} "
        f"{'naive':>10} | {'bubble':>7} {'formula':>7} {'ideal sim':>9} | recv-wait share"
    ]
    for world, settings in groups.items():
        payload = {"settings": settings, "layer_ms": layer_ms, "repeats": repeats}
        per_rank = run_workers(world, "benchmarks.pipeline:bench_worker", payload, timeout_s=600)
        for index, setting in enumerate(settings):
            results = [rank_results[index] for rank_results in per_rank]
            pp, v, m, layers, size = setting
            sent = sum(r["sent"] for r in results)
            expected = results[0]["expected"]
            bubble = statistics.mean(r["bubble"] for r in results)
            wait = statistics.mean(r["recv_wait"] for r in results)
            ideal = simulate(pp, v, m).bubble_fraction
            rows.append(
                f"{pp:>2} {v:>2} {m:>2} {layers:>2} {size:>2} | {sent:>10} {expected['exact']:>10} "
                f"{expected['paper']:>10} {expected['naive']:>10} | {bubble:>7.3f} "
                f"{bubble_formula(pp, v, m):>7.3f} {ideal:>9.3f} | {wait:.3f}"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan-only", action="store_true", help="print only the protocol table (no processes)")
    parser.add_argument("--layer-ms", type=float, default=15.0, help="sleep per decoder layer forward (backward 2x)")
    parser.add_argument("--repeats", type=int, default=2, help="measured steps per setting (after one warm-up)")
    args = parser.parse_args()
    print("Block tensors carried per micro-batch by the forward hops (backward returns as many gradients):")
    print(plan_table())
    if args.plan_only:
        return
    print(
        f"\nMeasured on gloo/CPU (bytes of one step, forward + backward, all ranks; sleep {args.layer_ms} ms "
        f"per layer forward, {2 * args.layer_ms} ms backward):"
    )
    print(measured_table(args.layer_ms, args.repeats))


if __name__ == "__main__":
    main()
