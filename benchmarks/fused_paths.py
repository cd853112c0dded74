"""The step's fused elementwise paths against their references, side by side in one process.

The fused paths keep a plain-PyTorch reference beside them, so "before" and "after" can run in
the same process, alternated, on a shared machine:

- SiTU-GLU: `situ_glu` (closed-form backward) vs `situ_glu_reference` (autograd over the formula),
  on the routed experts' `[4096, 256]` and the dense MLP's `[2, 512, 1408]`;
- the routed experts' slot gather: `latent.index_select(0, token_of_slot)` (backward: an
  `index_add_`) vs `latent[token_of_slot]` (backward: an accumulating `index_put_`), and
  `GroupedExperts.forward` (that gather, routing weights folded into the activation) vs
  `forward_reference` (weights applied to a copy of the expert outputs), GEMMs included;
- the routed experts' SiTU-GLU as they run it (routing weights as the row scale, the GEMM
  outputs overwritten by the saved tensors) vs the formula times the weights;
- RMSNorm (the model's norms): `rms_norm` (closed-form backward) vs `rms_norm_reference`;
- MLA attention: `causal_attention` (v zero-padded, SDPA's fused kernel) vs the unpadded call
  (SDPA's math path), 2 × 8 heads × 512 tokens, qk 96, v 64.

Then the wide512 model's AdamW `train_step` (benchmarks/step_vs_dense.py's 512-wide model), two
trainers built alike, one switched to the SiTU-GLU, routed-combine, latent-norm and attention
references, steps alternated, and one profiled step of each split into step_vs_dense.py's parts.
Times are this process's CPU seconds (`time.process_time`, one thread): a loaded machine disturbs
them far less than wall-clock time.

    OMP_NUM_THREADS=1 nice python benchmarks/fused_paths.py               # ~2 min on a quiet machine
    OMP_NUM_THREADS=1 nice python benchmarks/fused_paths.py --no-step     # kernels only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from functools import partial

import torch

import k3train.benchmarking.step_comparison as step_bench
import k3train.model.mla as mla_module
from k3train.config import load_config
from k3train.kernels.norms import rms_norm, rms_norm_reference
from k3train.kernels.situ_glu import situ_glu, situ_glu_reference
from k3train.model.config import ModelConfig
from k3train.model.mlp import GLUMLP
from k3train.model.moe import GroupedExperts
from k3train.model.norm import RMSNorm


def cpu_ms(function, repeats: int) -> float:
    started = time.process_time()
    for _ in range(repeats):
        function()
    return (time.process_time() - started) / repeats * 1e3


def alternate(contenders: dict, rounds: int, repeats: int) -> dict[str, float]:
    """Median over `rounds` of each contender's mean CPU ms over `repeats` calls, in alternation."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for function in contenders.values():
        function()  # warm-up
    for _ in range(rounds):
        for name, function in contenders.items():
            samples[name].append(cpu_ms(function, repeats))
    return {name: statistics.median(values) for name, values in samples.items()}


def forward_backward(function, inputs, grad_out):
    def run():
        for tensor in inputs:
            tensor.grad = None
        function(*inputs).backward(grad_out)

    return run


def unpadded_attention(q, k_nope, k_rope, v, scale):
    return mla_module.causal_attention_reference(q, torch.cat([k_nope, k_rope], dim=-1), v, scale)


def kernel_rows(rounds: int) -> list[list[str]]:
    generator = torch.Generator().manual_seed(0)
    rows = []

    def add(label: str, before, after, inputs, grad_out, repeats: int):
        times = alternate(
            {"before": forward_backward(before, inputs, grad_out), "after": forward_backward(after, inputs, grad_out)},
            rounds,
            repeats,
        )
        rows.append(
            [label, f"{times['before']:.2f}", f"{times['after']:.2f}", f"{times['before'] / times['after']:.2f}x"]
        )

    for shape in [(4096, 256), (2, 512, 1408)]:
        inputs = [torch.randn(shape, generator=generator).requires_grad_() for _ in range(2)]
        add(
            f"SiTU-GLU {list(shape)}", situ_glu_reference, situ_glu, inputs, torch.randn(shape, generator=generator), 10
        )

    # The routed experts' activation as GroupedExperts runs it: routing weights as the row scale,
    # the gate/up GEMM outputs (fresh copies here) overwritten by the saved tensors.
    shape = (4096, 256)
    gate, up = (torch.randn(shape, generator=generator).requires_grad_() for _ in range(2))
    row_scale = torch.rand(shape[0], generator=generator).requires_grad_()
    add(
        f"SiTU-GLU {list(shape)}, routed (row scale, GEMM outputs as scratch)",
        lambda g, u, r: reference_activation(g * 1.0, u * 1.0, 4.0, 25.0, row_scale=r),
        lambda g, u, r: situ_glu(g * 1.0, u * 1.0, 4.0, 25.0, row_scale=r, overwrite_inputs=True),
        [gate, up, row_scale],
        torch.randn(shape, generator=generator),
        10,
    )

    tokens, top_k, experts, width = 1024, 4, 16, 256  # the routed slots of one wide512 MoE layer
    routed = torch.randn(tokens, width, generator=generator).requires_grad_()
    norm_weight = torch.randn(width, generator=generator).requires_grad_()
    add(
        f"latent RMSNorm [{tokens}, {width}]",
        lambda x, w: rms_norm_reference(x, w, 1e-5),
        lambda x, w: rms_norm(x, w, 1e-5),
        [routed, norm_weight],
        torch.randn(tokens, width, generator=generator),
        20,
    )
    token_of_slot = (
        torch.argsort(torch.randint(0, experts, (tokens * top_k,), generator=generator), stable=True) // top_k
    )
    latent = torch.randn(tokens, width, generator=generator).requires_grad_()
    add(
        f"routed slot gather [{tokens}, {width}] -> [{tokens * top_k}, {width}]",
        lambda x: x[token_of_slot],
        lambda x: x.index_select(0, token_of_slot),
        [latent],
        torch.randn(tokens * top_k, width, generator=generator),
        20,
    )
    config = dataclasses.replace(
        ModelConfig(),
        num_experts=experts,
        num_experts_per_token=top_k,
        moe_intermediate_size=256,
        routed_expert_hidden_size=width,
    )
    local = GroupedExperts(config, experts)
    for stack in local.stacks():
        torch.nn.init.normal_(stack, std=0.05)
    expert_ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator).requires_grad_()
    add(
        f"routed experts, grouped GEMMs included ({tokens} tokens x top-{top_k})",
        lambda x, w: local.forward_reference(x, expert_ids, w),
        lambda x, w: local(x, expert_ids, w),
        [latent, weights],
        torch.randn(tokens, width, generator=generator),
        5,
    )

    batch, seq, heads = 2, 512, 8
    q = torch.randn(batch, seq, heads, 96, generator=generator).requires_grad_()
    k_nope = torch.randn(batch, seq, heads, 64, generator=generator).requires_grad_()
    k_rope = torch.randn(batch, seq, 1, 32, generator=generator).requires_grad_()
    v = torch.randn(batch, seq, heads, 64, generator=generator).requires_grad_()

    def attention(function):
        return lambda q, k_nope, k_rope, v: function(q, k_nope, k_rope.expand(-1, -1, heads, -1), v, 96**-0.5)

    add(
        f"MLA attention B={batch} H={heads} T={seq}",
        attention(unpadded_attention),
        attention(mla_module.causal_attention),
        [q, k_nope, k_rope, v],
        torch.randn(batch, seq, heads, 64, generator=generator),
        2,
    )
    return rows


def reference_activation(gate, up, beta, linear_beta, row_scale=None, overwrite_inputs=False):
    """`situ_glu_reference` with `situ_glu`'s signature (`overwrite_inputs` changes nothing)."""
    out = situ_glu_reference(gate, up, beta, linear_beta)
    return out if row_scale is None else (out * row_scale.unsqueeze(-1)).to(out.dtype)


def use_references(model: torch.nn.Module) -> None:
    """Switch a model's SiTU-GLU, routed combine and RMSNorms to their references (MLA's
    attention: `reference_attention`)."""
    for module in model.modules():
        if (
            isinstance(module, (GLUMLP, GroupedExperts))
            and isinstance(module.activation, partial)
            and module.activation.func is situ_glu
        ):
            module.activation = partial(reference_activation, **module.activation.keywords)
        if isinstance(module, GroupedExperts):
            module.forward = module.forward_reference  # type: ignore[method-assign]  # per-instance swap to the reference, on purpose
        if isinstance(module, RMSNorm):
            module.forward = partial(  # type: ignore[method-assign]  # per-instance swap to the reference, on purpose
                lambda x, norm: rms_norm_reference(x, norm.weight, norm.eps), norm=module
            )


@contextlib.contextmanager
def reference_attention():
    fused = mla_module.causal_attention
    mla_module.causal_attention = unpadded_attention
    try:
        yield
    finally:
        mla_module.causal_attention = fused


def step_tables(steps: int, profiled: int) -> None:
    config = load_config(
        str(step_bench.DEBUG_RECIPE),
        [
            *step_bench.WIDE_MODEL,
            f"train.steps={2 * (steps + profiled) + 4}",
            "optimizer.name=adamw",
            "logging.jsonl=false",
        ],
    )
    after = step_bench.k3_trainer(config)
    before = step_bench.k3_trainer(config)
    use_references(before.model)

    def before_step():
        with reference_attention():
            before.train_step()

    times = alternate({"before": before_step, "after": after.train_step}, steps, 1)
    print(
        f"\nwide512 AdamW train_step, {steps} alternated steps each, median CPU s: before (references) "
        f"{times['before'] / 1e3:.3f} s, after {times['after'] / 1e3:.3f} s "
        f"({times['before'] / times['after']:.2f}x)"
    )
    profiles: dict[str, list[tuple[dict[str, float], float]]] = {"before": [], "after": []}

    def profile_before():
        with reference_attention():
            profiles["before"].append(step_bench.profile_parts(before))

    def profile_after():
        profiles["after"].append(step_bench.profile_parts(after))

    # Alternated, the order swapped every round; the profiler's times are wall-clock: medians.
    for round_index in range(profiled):
        for profile in (profile_after, profile_before)[:: 1 if round_index % 2 else -1]:
            profile()

    def median(name, part=None):
        return statistics.median(wall if part is None else seconds[part] for seconds, wall in profiles[name])

    step_bench.table(
        ["part", "before (s)", "after (s)"],
        [[part, f"{median('before', part):.3f}", f"{median('after', part):.3f}"] for part in step_bench.PARTS]
        + [["step under the profiler", f"{median('before'):.3f}", f"{median('after'):.3f}"]],
        f"profiled AdamW steps, split into step_vs_dense.py's parts (median of {profiled} each)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds per kernel")
    parser.add_argument("--steps", type=int, default=3, help="alternated train steps per trainer")
    parser.add_argument("--profiled", type=int, default=3, help="profiled train steps per trainer")
    parser.add_argument("--no-step", action="store_true", help="kernels only")
    args = parser.parse_args()
    step_bench.table(
        ["path, fwd+bwd", "before (ms)", "after (ms)", "speed-up"],
        kernel_rows(args.rounds),
        f"kernels, median CPU ms per call over {args.rounds} alternated rounds",
    )
    if not args.no_step:
        step_tables(args.steps, args.profiled)


if __name__ == "__main__":
    main()
