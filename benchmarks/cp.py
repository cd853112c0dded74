"""Context parallelism at K3 shapes: bytes per step for the KDA state and MLA KV exchanges, and
the measured cost that decides how KDA's state crosses the pieces.

Part 1 (formulas, per layer and per sequence, wire bytes one rank receives in forward + backward):
- KDA "handoff" (the default): one `[H, K, V]` fp32 state per piece boundary each way, plus the
  three short convolutions' tails (bf16, all-gathered);
- KDA "gather": the pieces' affine maps `(A, B)` (`[H, K, K + V]` fp32 each) all-gathered
  (backward: reduce-scatter), plus the tails;
- MLA, the chosen scheme: the compressed KV (`kv_lora_rank + qk_rope_head_dim` per token, bf16)
  all-gathered (backward: reduce-scatter);
- MLA, a ring: every head's K and V (`H · (qk_head_dim + v_head_dim)` per token, bf16) passed
  around (backward: their gradients);
against the bytes of one layer's input activation on a rank (`2L · hidden`, bf16).

Part 2 (measured, side by side in one process, medians): the chunkwise kernel's forward+backward
on one piece with `V` value columns (a piece whose entering state is known) and with `V + K`
(the extended run that yields the piece's affine maps), one step of the state chain
(`S ← A S + B` and its backward), and the fold over the 2C maps. Critical paths of a KDA layer:
- state handed along *before* each piece's run (no extended run): `2C · t(V)`, every piece waits;
- "handoff" as implemented (every piece's extended run at once, then the chain): `t(V+K) + 2C ·
  (chain step + one hop)`;
- "gather": `t(V+K) + fold(2C) + one all-gather`.
Hops are not timed here (no network on one machine); the byte table gives their size.

    OMP_NUM_THREADS=1 nice python benchmarks/cp.py --seq-length 131072 --piece 256 --heads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from k3train.kernels.kda import chunk_kda

# K3 (recipes/k3.yaml): hidden 7168, 96 KDA heads of 128, MLA latent 512 + 64 rope, 96 MLA heads
# with qk_head_dim 192 and v_head_dim 128, short convolutions of 4 taps.
K3 = dict(
    hidden=7168,
    kda_heads=96,
    head_dim=128,
    kv_lora_rank=512,
    rope=64,
    mla_heads=96,
    qk_head_dim=192,
    v_head_dim=128,
    conv_kernel=4,
)
FP32, BF16 = 4, 2


def exchange_bytes(seq_length: int, cp: int, tp: int = 1, shapes: dict = K3) -> dict[str, float]:
    """Wire bytes one rank receives per layer and sequence (forward + backward), and the layer input."""
    pieces, piece = 2 * cp, seq_length // (2 * cp)
    heads = shapes["kda_heads"] // tp
    key, value = shapes["head_dim"], shapes["head_dim"]
    transition = heads * key * (key + value) * FP32  # one piece's (A, B)
    tails = 3 * (shapes["conv_kernel"] - 1) * heads * key * BF16
    # all-gather: the 2(C − 1) pieces of the others; reduce-scatter back: the same amount.
    kda_gather = 2 * (pieces - 2) * (transition + tails)
    # The busiest rank receives the states of two boundaries forward and two backward; the tails
    # are all-gathered as under "gather".
    kda_handoff = 2 * min(2, cp - 1) * heads * key * value * FP32 + 2 * (pieces - 2) * tails
    latent = (shapes["kv_lora_rank"] + shapes["rope"]) * BF16
    others = (pieces - 2) * piece  # tokens held by the other ranks
    mla_gather = 2 * others * latent
    mla_ring = 2 * others * (shapes["mla_heads"] // tp) * (shapes["qk_head_dim"] + shapes["v_head_dim"]) * BF16
    activation = 2 * piece * shapes["hidden"] * BF16
    return dict(
        kda_gather=kda_gather, kda_handoff=kda_handoff, mla_gather=mla_gather, mla_ring=mla_ring, activation=activation
    )


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def print_bytes_table(seq_length: int, tp: int) -> None:
    print(f"bytes per layer and sequence of {seq_length} tokens, one rank, forward + backward (MiB), tp={tp}")
    print(
        f"{'C':>3} {'tokens/rank':>11} {'KDA gather':>11} {'KDA handoff':>12} {'MLA latent':>11} "
        f"{'MLA ring':>10} {'layer input':>12}"
    )
    for cp in (2, 4, 8, 16):
        row = exchange_bytes(seq_length, cp, tp)
        print(
            f"{cp:>3} {seq_length // cp:>11} {mib(row['kda_gather']):>11} {mib(row['kda_handoff']):>12} "
            f"{mib(row['mla_gather']):>11} {mib(row['mla_ring']):>10} {mib(row['activation']):>12}"
        )


def kda_inputs(piece: int, heads: int, key: int, value: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (1, piece, heads, key)
    tensors = {
        "q": F.normalize(torch.randn(shape, generator=generator), dim=-1),
        "k": F.normalize(torch.randn(shape, generator=generator), dim=-1),
        "v": torch.randn(1, piece, heads, value, generator=generator),
        "g": -5.0 * torch.sigmoid(torch.randn(shape, generator=generator)),
        "beta": torch.sigmoid(torch.randn(shape[:3], generator=generator)),
    }
    return {name: tensor.requires_grad_() for name, tensor in tensors.items()}


def time_kda(inputs: dict[str, torch.Tensor], initial_state: torch.Tensor, chunk_size: int) -> float:
    started = time.perf_counter()
    o, state = chunk_kda(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        inputs["g"],
        inputs["beta"],
        initial_state=initial_state,
        output_final_state=True,
        chunk_size=chunk_size,
        backend="torch",
    )
    assert state is not None, "chunk_kda returns the final state when asked for it"
    (o.sum() + state.sum()).backward()
    return time.perf_counter() - started


def time_chain_step(heads: int, key: int, value: int) -> float:
    """One step of the handoff chain, forward and backward: `S_out = A S_in + B` for one piece."""
    transition = torch.randn(heads, key, key, requires_grad=True)
    offset = torch.randn(heads, key, value, requires_grad=True)
    entering = torch.randn(heads, key, value, requires_grad=True)
    started = time.perf_counter()
    (transition @ entering + offset).sum().backward()
    return time.perf_counter() - started


def time_fold(pieces: int, heads: int, key: int, value: int) -> float:
    maps = torch.randn(pieces, heads, key, key + value, requires_grad=True)
    started = time.perf_counter()
    state = torch.zeros(heads, key, value)
    for index in range(pieces):
        state = maps[index, ..., :key] @ state + maps[index, ..., key:]
    state.sum().backward()
    return time.perf_counter() - started


def measure(piece: int, heads: int, chunk_size: int, repeats: int, cps: list[int]) -> None:
    key = value = K3["head_dim"]
    plain = kda_inputs(piece, heads, key, value)
    extended = kda_inputs(piece, heads, key, value + key)
    state_plain = torch.zeros(1, heads, key, value)
    state_extended = torch.zeros(1, heads, key, value + key)
    times: dict[str, list[float]] = {"plain": [], "extended": [], "chain": []}
    folds: dict[int, list[float]] = {cp: [] for cp in cps}
    for _ in range(repeats):  # alternate, so a drifting machine hits both alike
        times["plain"].append(time_kda(plain, state_plain, chunk_size))
        times["extended"].append(time_kda(extended, state_extended, chunk_size))
        times["chain"].append(time_chain_step(heads, key, value))
        for cp in cps:
            folds[cp].append(time_fold(2 * cp, heads, key, value))
    t_plain, t_extended = statistics.median(times["plain"]), statistics.median(times["extended"])
    t_chain = statistics.median(times["chain"])
    print(
        f"\nKDA piece of {piece} tokens, {heads} heads of {key}, chunk {chunk_size}, fp32 fwd+bwd on CPU "
        f"({torch.get_num_threads()} threads), medians of {repeats}:"
    )
    print(f"  t(V)   = {t_plain * 1e3:8.1f} ms   (a piece whose entering state is known)")
    print(
        f"  t(V+K) = {t_extended * 1e3:8.1f} ms   (the extended run: o, and the maps A, B, M) "
        f"= {t_extended / t_plain:.2f} x t(V)"
    )
    print(f"  chain step = {t_chain * 1e3:6.2f} ms   (S_out = A S_in + B, fwd+bwd)")
    print("critical path of one KDA layer, compute only (ms):")
    print(f"{'C':>3} {'state first':>12} {'handoff':>9} {'gather':>9} {'state first / handoff':>22}")
    for cp in cps:
        fold = statistics.median(folds[cp])
        serial, handoff, gather = 2 * cp * t_plain, t_extended + 2 * cp * t_chain, t_extended + fold
        print(f"{cp:>3} {serial * 1e3:>12.1f} {handoff * 1e3:>9.1f} {gather * 1e3:>9.1f} {serial / handoff:>22.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=131072)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (KDA/MLA heads per rank)")
    parser.add_argument("--piece", type=int, default=256, help="tokens of the timed KDA piece")
    parser.add_argument("--heads", type=int, default=2, help="KDA heads in the timed piece (K3: 96 / tp)")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-timing", action="store_true", help="print the byte table only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print_bytes_table(args.seq_length, args.tp)
    if not args.no_timing:
        measure(args.piece, args.heads, args.chunk_size, args.repeats, [2, 4, 8, 16])
    return 0


if __name__ == "__main__":
    sys.exit(main())
