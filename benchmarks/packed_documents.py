"""What keeping packed documents apart costs: step time with `data.document_boundaries=reset`
over `none` on the same data, the 512-wide K3-shaped model (k3train.benchmarking's
`WIDE_MODEL`: hidden 512, 3 KDA + 1 MLA layers, 2 × 2 sequences of 512 tokens per step).

The embedded corpus's documents (standard-library modules) are mostly longer than a sequence,
so most rows would hold no boundary at all. The benchmark therefore cuts the corpus's tokens
into documents of `--document-length` tokens on average (uniform in [L/2, 3L/2), written as an
indexed dataset in a temporary directory; `--document-length 0` keeps the corpus as it is).
Both contenders are the job's own trainer (`build_rank` + `Trainer.train_step`, Per-Head
Muon, fp32), built from the same seed and reading the same batches; their steps alternate, so
a busy machine slows both alike. Prints the median step times, their ratio, and the FLOP
count's ratio (`k3train/model/flops.py` with the documents of the rows of one batch).

    OMP_NUM_THREADS=1 nice python benchmarks/packed_documents.py            # ~4 min on 2 cores
    OMP_NUM_THREADS=1 nice python benchmarks/packed_documents.py --document-length 0 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from k3train.benchmarking.step_comparison import DEBUG_RECIPE, WIDE_MODEL, k3_trainer
from k3train.config import load_config
from k3train.data import IndexedDataset, write_indexed_dataset
from k3train.data.corpus import default_corpus_prefix, resolve_cache_dir
from k3train.data.documents import document_lengths
from k3train.model.flops import training_flops_per_token


def cut_corpus(directory: Path, mean_length: int, max_tokens: int, seed: int = 0) -> str:
    """The embedded corpus's first `max_tokens` tokens as documents of about `mean_length`."""
    corpus = IndexedDataset(default_corpus_prefix(resolve_cache_dir(None)))
    tokens = np.asarray(corpus.tokens[: min(max_tokens, corpus.num_tokens)], dtype=np.int64)
    rng = np.random.default_rng(seed)
    documents, start = [], 0
    while start < len(tokens):
        length = int(rng.integers(mean_length // 2, mean_length * 3 // 2))
        documents.append(tokens[start : start + length])
        start += length
    prefix = str(directory / f"corpus_cut_{mean_length}")
    write_indexed_dataset(prefix, documents, vocab_size=259)
    return prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--document-length", type=int, default=128, help="mean document tokens (0: the corpus as is)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per contender (after one warm-up)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        data = []
        if args.document_length:
            data = [f"data.paths=[{cut_corpus(Path(scratch), args.document_length, 2_000_000)}]"]
        common = [*WIDE_MODEL, *data, f"train.steps={args.steps + 2}", "logging.jsonl=false", "train.precision=fp32"]
        trainers = {
            boundaries: k3_trainer(load_config(str(DEBUG_RECIPE), [*common, f"data.document_boundaries={boundaries}"]))
            for boundaries in ("none", "reset")
        }
        config = trainers["reset"].config
        seq = config.data.seq_length
        peek = trainers["reset"].data.next_batch(config.train.global_batch_size)
        trainers["reset"].data.load_state_dict(trainers["none"].data.state_dict())  # back to the start
        assert peek.document_starts is not None
        rows = document_lengths(peek.document_starts)
        apart = statistics.mean(
            training_flops_per_token(config.model, seq, document_lengths=lengths).total for lengths in rows
        )
        stream = training_flops_per_token(config.model, seq).total
        seconds: dict[str, list[float]] = {name: [] for name in trainers}
        for step in range(args.steps + 1):
            for name, trainer in trainers.items():
                started = time.perf_counter()
                trainer.train_step()
                if step:  # the first step of each is a warm-up
                    seconds[name].append(time.perf_counter() - started)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    documents = statistics.mean(len(lengths) for lengths in rows)
    print(
        f"512-wide model, {config.train.global_batch_size} x {seq} tokens per step, "
        f"{documents:.1f} documents per sequence (first batch), {args.steps} steps each after a warm-up"
    )
    for name, value in median.items():
        print(
            f"  document_boundaries={name:5s} median step {value:.3f} s  ({', '.join(f'{s:.3f}' for s in seconds[name])})"
        )
    print(f"  step time reset/none: {median['reset'] / median['none']:.3f}")
    print(f"  training FLOPs per token reset/none: {apart / stream:.4f} ({apart / 1e6:.1f} / {stream / 1e6:.1f} MFLOP)")


if __name__ == "__main__":
    main()
