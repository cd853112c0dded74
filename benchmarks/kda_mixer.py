"""Time KDA's mixer (`KimiDeltaAttention`, forward + backward) on its fast kernels against the
same module on the plain-PyTorch references, side by side in one process.

"fast" is the mixer as the model runs it (`kernels/short_conv.py`, `kernels/norms.py`, the
closed-form gates of `kernels/kda/gate.py`); "reference" swaps in their `*_reference`
definitions (channels-first `F.conv1d` + SiLU, autograd through the norms and gates). Two
rows: the whole mixer with the chunkwise KDA kernel, and the mixer around it, with `chunk_kda`
replaced by a cheap stand-in (`(q + k + v + g) · β`, the same in both columns, so the
difference is the projections side alone). The shapes are the wide512 model's of
`benchmarks/step_vs_dense.py` (hidden 512, 8 heads × 64, micro-batch 2 × 512 tokens, fp32).
Each repeat times every contender once, in alternation; the table gives medians of this
process's CPU time (robust to other load on the machine) and their ratio.

With `--step`, also the whole training step of that model (`benchmarks/step_vs_dense.py`'s
wide512 model and AdamW trainer: 3 KDA layers, 2 micro-batches), the mixers on the reference
kernels against the fast ones, alternated step by step in the same process; the difference is
what the fast kernels save per step.

    OMP_NUM_THREADS=1 nice python benchmarks/kda_mixer.py --repeats 15
    OMP_NUM_THREADS=1 nice python benchmarks/kda_mixer.py --repeats 15 --step --step-repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from k3train.config import load_config
from k3train.kernels.kda import kda_gate_reference, kda_gate_unbounded_reference, raw_inputs
from k3train.kernels.norms import gated_rms_norm_reference, l2_normalize_reference
from k3train.kernels.short_conv import short_conv_silu_reference
from k3train.model import kda as kda_module

ROOT = Path(__file__).resolve().parents[1]
WIDE_MODEL = [
    "model.hidden_size=512",
    "model.linear_attn_config.num_heads=8",
    "model.linear_attn_config.head_dim=64",
]
REFERENCES = {
    "short_conv_silu": short_conv_silu_reference,
    "l2_normalize": l2_normalize_reference,
    "gated_rms_norm": gated_rms_norm_reference,
    "kda_gate": kda_gate_reference,
    "kda_gate_unbounded": kda_gate_unbounded_reference,
}


def stand_in_kernel(q, k, v, g, beta, **_):
    """Touches every input of `chunk_kda` once, so every gradient path of the mixer runs."""
    return (q + k + v + g) * beta.unsqueeze(-1), None


def _home(name: str):
    """The module whose global `name` the mixer's path looks up: the short convolution and the
    output norm are called by the mixer, the normalisation, gates and kernel next to the kernel
    (`kernels/kda/raw_inputs.py`)."""
    return kda_module if name in ("short_conv_silu", "gated_rms_norm") else raw_inputs


@contextlib.contextmanager
def patched(names: Mapping[str, object]):
    saved = {name: getattr(_home(name), name) for name in names}
    for name, value in names.items():
        setattr(_home(name), name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(_home(name), name, value)


def time_step(mixer: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor, swaps: Mapping[str, object]) -> float:
    with patched(swaps):
        start = time.process_time()
        (mixer(x) * probe).sum().backward()
        elapsed = time.process_time() - start
    mixer.zero_grad(set_to_none=True)
    x.grad = None
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--step", action="store_true", help="also time the wide512 model's AdamW training step")
    parser.add_argument("--step-repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(str(ROOT / "recipes" / "debug.yaml"), WIDE_MODEL).model
    torch.manual_seed(0)
    mixer = kda_module.KimiDeltaAttention(config)
    x = torch.randn(args.batch, args.seq, config.hidden_size, requires_grad=True)
    probe = torch.randn(args.batch, args.seq, config.hidden_size)
    lac = config.linear_attn_config
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); KimiDeltaAttention hidden "
        f"{config.hidden_size}, {lac.num_heads} heads x {lac.head_dim}, B={args.batch} T={args.seq}, fp32; "
        f"forward + backward, median of {args.repeats} (process CPU time)\n"
    )
    rows: dict[str, dict[str, object]] = {
        "mixer with chunk_kda": {},
        "mixer around chunk_kda (stand-in kernel)": {"chunk_kda": stand_in_kernel},
    }
    print("| | reference kernels (ms) | fast kernels (ms) | reference / fast |")
    print("|---|---:|---:|---:|")
    for row, kernel_swap in rows.items():
        contenders = {"reference": {**REFERENCES, **kernel_swap}, "fast": dict(kernel_swap)}
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for swaps in contenders.values():  # warm-up
            time_step(mixer, x, probe, swaps)
        for _ in range(args.repeats):
            for name, swaps in contenders.items():  # alternated: drifts hit both alike
                times[name].append(time_step(mixer, x, probe, swaps))
        reference, fast = (statistics.median(times[name]) for name in ("reference", "fast"))
        print(f"| {row} | {reference * 1e3:.1f} | {fast * 1e3:.1f} | {reference / fast:.2f}x |")
    time_kernels(args.batch, args.seq, config.hidden_size, lac.num_heads, lac.head_dim, args.repeats)
    if args.step:
        time_training_step(args.step_repeats)


def time_kernels(batch: int, seq: int, hidden: int, heads: int, head_dim: int, repeats: int) -> None:
    """Each kernel alone, forward + backward on the mixer's shapes, reference against fast."""
    from k3train.kernels.kda import kda_gate
    from k3train.kernels.norms import gated_rms_norm, l2_normalize
    from k3train.kernels.short_conv import short_conv_silu

    generator = torch.Generator().manual_seed(0)
    width = heads * head_dim

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_()

    conv_x, conv_w = tensor(batch, seq, width), tensor(width, 1, 4)
    norm_x, norm_gate, norm_w = (
        tensor(batch, seq, heads, head_dim),
        tensor(batch, seq, heads, head_dim),
        tensor(head_dim),
    )
    gate_z, a_log, dt_bias = tensor(batch, seq, heads, head_dim), tensor(heads), tensor(width)
    cases = {
        "short conv + SiLU (one of q/k/v)": (
            lambda: short_conv_silu_reference(conv_x, conv_w)[0],
            lambda: short_conv_silu(conv_x, conv_w)[0],
        ),
        "l2 normalise (one of q/k)": (lambda: l2_normalize_reference(norm_x), lambda: l2_normalize(norm_x)),
        "gated RMSNorm": (
            lambda: gated_rms_norm_reference(norm_x, norm_gate, norm_w, 1e-5),
            lambda: gated_rms_norm(norm_x, norm_gate, norm_w, 1e-5),
        ),
        "decay gate (bounded)": (
            lambda: kda_gate_reference(gate_z, a_log, dt_bias),
            lambda: kda_gate(gate_z, a_log, dt_bias),
        ),
    }
    print("\n| kernel, forward + backward | reference (ms) | fast (ms) | reference / fast |")
    print("|---|---:|---:|---:|")
    for name, (reference, fast) in cases.items():
        times: dict[str, list[float]] = {"reference": [], "fast": []}

        def once(function) -> float:
            start = time.process_time()
            out = function()
            out.backward(torch.ones_like(out))
            return time.process_time() - start

        once(reference), once(fast)  # warm-up
        for _ in range(repeats):
            times["reference"].append(once(reference))
            times["fast"].append(once(fast))
        ref_time, fast_time = statistics.median(times["reference"]), statistics.median(times["fast"])
        print(f"| {name} | {ref_time * 1e3:.2f} | {fast_time * 1e3:.2f} | {ref_time / fast_time:.2f}x |")


def time_training_step(repeats: int) -> None:
    """The wide512 model's AdamW step (`step_vs_dense.k3_trainer`) with its KDA mixers on the
    reference kernels and on the fast ones, alternated."""
    from k3train.benchmarking import step_comparison as step_vs_dense

    config = load_config(
        str(step_vs_dense.DEBUG_RECIPE),
        [*step_vs_dense.WIDE_MODEL, f"train.steps={2 * repeats + 4}", "logging.jsonl=false", "optimizer.name=adamw"],
    )
    trainer = step_vs_dense.k3_trainer(config)
    contenders: dict[str, Mapping[str, object]] = {"reference": REFERENCES, "fast": {}}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for swaps in contenders.values():  # warm-up
        with patched(swaps):
            trainer.train_step()
    for _ in range(repeats):
        for name, swaps in contenders.items():
            with patched(swaps):
                start = time.process_time()
                trainer.train_step()
                times[name].append(time.process_time() - start)
    reference, fast = (statistics.median(times[name]) for name in ("reference", "fast"))
    print(
        f"\nwide512 training step (AdamW, {config.train.global_batch_size // config.train.micro_batch_size} "
        f"micro-batches of {config.train.micro_batch_size}x{config.data.seq_length}), median of {repeats} "
        f"(process CPU time): reference kernels {reference:.3f} s, fast kernels {fast:.3f} s, "
        f"saved {(reference - fast) * 1e3:.0f} ms per step ({reference / fast:.3f}x)"
    )


if __name__ == "__main__":
    main()
