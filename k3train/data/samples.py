"""From indexed datasets to training batches: split, packing, shuffling, blending, resumable position.

The steps, as in Megatron's `GPTDataset` / `BlendedDataset`:

1. **Split by documents.** Of each dataset's `D` documents, `round(D * validation_fraction)`
   (at least one when the fraction is positive) are held out for validation, spread evenly over
   the file (`floor((j + 1/2) * D / n_valid)`). The split depends on nothing else, so changing
   the seed never moves a document between train and validation.
2. **Pack.** An epoch lays a dataset's training documents end to end, each followed by an eos
   (unless its last token already is one, as `tools/preprocess_data.py --append-eos` writes), and
   cuts the stream into samples of `seq_length + 1` tokens with a stride of `seq_length`:
   sample `s` is `stream[s*L : s*L + L + 1]`, inputs `[:-1]`, labels `[1:]`. Every token is thus
   a label exactly once per epoch; the last `< L` tokens of the stream are dropped.
3. **Shuffle.** Epoch `e` of dataset `i` orders its documents and then its samples with two
   permutations drawn from `SeedSequence([seed, i, e, purpose])`; each epoch reshuffles.
4. **Blend.** Sample `n` of the run goes to the dataset with the largest deficit
   `w_d * (n + 1) - taken_d` (ties to the lower index) -- Megatron's greedy "most under-served
   dataset next" -- so every dataset's share stays within one sample of its weight.
5. **Batch.** Global batch `b` is samples `[b*G, (b+1)*G)` of that blended stream whatever the
   data-parallel size; rank `r` of `dp` receives rows `[r*G/dp, (r+1)*G/dp)`. The position
   (`consumed_samples` and samples taken per dataset) is the whole state; a fingerprint of the
   data settings and files travels with it, so a resume against other data is refused.

Nothing is cached on disk: every index is a few numpy operations per epoch, built lazily.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3train.contracts.token_batch import TokenBatch
from k3train.data.config import DataConfig
from k3train.data.corpus import default_corpus_prefix, resolve_cache_dir
from k3train.data.documents import token_batch
from k3train.data.indexed_dataset import DataError, IndexedDataset
from k3train.data.tokenizers import ByteTokenizer, Tokenizer, build_tokenizer

STATE_VERSION = 1
"""Version of the dict `TrainingData.state_dict()` returns."""
SCAN_LIMIT_BYTES = 1 << 30
"""Datasets up to this size are scanned for out-of-vocabulary ids when the data is built; every
batch is checked as it is read anyway."""
_SHUFFLE_DOCUMENTS, _SHUFFLE_SAMPLES = 0, 1  # the `purpose` word of the shuffle seeds


def split_documents(num_documents: int, validation_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """`(train_ids, valid_ids)`: a deterministic, disjoint split of `range(num_documents)`."""
    if not 0.0 <= validation_fraction < 1.0:
        raise DataError(f"data.validation_fraction = {validation_fraction} must be in [0, 1)")
    num_valid = int(round(num_documents * validation_fraction))
    if validation_fraction > 0 and num_documents >= 2:
        num_valid = min(max(num_valid, 1), num_documents - 1)
    if num_valid == 0:
        return np.arange(num_documents, dtype=np.int64), np.zeros(0, dtype=np.int64)
    # Consecutive picks are at least one apart (num_documents / num_valid >= 1): all distinct.
    valid = np.floor((np.arange(num_valid) + 0.5) * (num_documents / num_valid)).astype(np.int64)
    is_valid = np.zeros(num_documents, dtype=bool)
    is_valid[valid] = True
    return np.flatnonzero(~is_valid), valid


def permutation(n: int, *seed_words: int) -> np.ndarray:
    """A permutation of `range(n)` fixed by `seed_words`.

    Argsorting raw PCG64 output rather than calling `Generator.permutation`: NumPy promises the
    bit generator's stream across versions, not the algorithms of `Generator` methods, and a
    resume must reproduce the order exactly.
    """
    words = [int(word) % (1 << 64) for word in seed_words]
    keys = np.random.PCG64(np.random.SeedSequence(words)).random_raw(n)
    return np.argsort(keys, kind="stable")


def greedy_blend(
    weights: Iterable[float], taken: Iterable[int], count: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The next `count` draws of the blend, given the samples `taken` from each dataset so far.

    Draw `n` (counted from the start of the run) picks the dataset with the largest deficit
    `w_d * (n + 1) - taken_d`, ties to the lower index. Returns `(dataset_ids, sample_ids,
    taken_after)`, where `sample_ids[i]` is the draw's index within its dataset's own stream.
    A plain loop: it runs once per global batch over `count` draws, never per token.
    """
    w = [float(x) for x in weights]
    done = [int(x) for x in taken]
    if len(w) == 1:
        start = done[0]
        return (
            np.zeros(count, dtype=np.int64),
            np.arange(start, start + count, dtype=np.int64),
            np.array([start + count], dtype=np.int64),
        )
    position = sum(done)
    dataset_ids, sample_ids = [0] * count, [0] * count
    for i in range(count):
        position += 1
        best, best_deficit = 0, w[0] * position - done[0]
        for d in range(1, len(w)):
            deficit = w[d] * position - done[d]
            if deficit > best_deficit:
                best, best_deficit = d, deficit
        dataset_ids[i] = best
        sample_ids[i] = done[best]
        done[best] += 1
    return (np.array(dataset_ids, dtype=np.int64), np.array(sample_ids, dtype=np.int64), np.array(done, dtype=np.int64))


@dataclass
class _Epoch:
    """The packing of one epoch: document order, where each document ends in the stream, and
    the (shuffled) order in which the packed samples are served."""

    document_order: np.ndarray
    stream_ends: np.ndarray
    sample_order: np.ndarray


class PackedDataset:
    """Some documents of an indexed dataset, packed into samples of `seq_length + 1` tokens.

    Sample ids run on across epochs: id `k` is sample `k % samples_per_epoch` (after the epoch's
    shuffle) of epoch `k // samples_per_epoch`.
    """

    def __init__(
        self,
        dataset: IndexedDataset,
        document_ids: np.ndarray,
        seq_length: int,
        eos_id: int,
        *,
        seed: int,
        salt: int,
        shuffle: bool,
        name: str,
    ) -> None:
        self.dataset = dataset
        self.seq_length = seq_length
        self.eos_id = eos_id
        self.name = name
        self._seed, self._salt, self._shuffle = seed, salt, shuffle
        starts, ends = dataset.document_spans()
        document_ids = np.asarray(document_ids, dtype=np.int64)
        lengths = ends[document_ids] - starts[document_ids]
        keep = document_ids[lengths > 0]  # an empty document would only add a lone eos
        self._doc_start = starts[keep]
        self._doc_len = ends[keep] - starts[keep]
        ends_in_eos = dataset.tokens[ends[keep] - 1] == eos_id if len(keep) else np.zeros(0, dtype=bool)
        self._stream_len = self._doc_len + (~ends_in_eos)
        self.num_documents = len(keep)
        """Non-empty documents in this split."""
        self.num_tokens = int(self._stream_len.sum())
        """Tokens of one epoch's stream, eos included."""
        self.samples_per_epoch = max(0, (self.num_tokens - 1) // seq_length)
        """Samples of `seq_length + 1` tokens one epoch yields."""
        self._epochs: dict[int, _Epoch] = {}

    def _epoch(self, epoch: int) -> _Epoch:
        """The packing of `epoch`, built on first use; the two most recent ones are kept."""
        if epoch not in self._epochs:
            if self._shuffle:
                order = permutation(self.num_documents, self._seed, self._salt, epoch, _SHUFFLE_DOCUMENTS)
                samples = permutation(self.samples_per_epoch, self._seed, self._salt, epoch, _SHUFFLE_SAMPLES)
            else:
                order = np.arange(self.num_documents, dtype=np.int64)
                samples = np.arange(self.samples_per_epoch, dtype=np.int64)
            self._epochs[epoch] = _Epoch(order, np.cumsum(self._stream_len[order]), samples)
            while len(self._epochs) > 2:  # sampling moves forward; an epoch boundary needs two
                del self._epochs[min(self._epochs)]
        return self._epochs[epoch]

    def samples(self, sample_ids: np.ndarray) -> np.ndarray:
        """Tokens of the given samples, int64 `[len(sample_ids), seq_length + 1]`."""
        return self.samples_with_starts(sample_ids)[0]

    def samples_with_starts(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`(tokens, starts)`: the tokens of the given samples as `samples` gives them, and bool
        `[len(sample_ids), seq_length]`, True at every input position where a document begins
        (from the document index: its first token, not a guess from eos tokens)."""
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        out = np.empty((len(sample_ids), self.seq_length + 1), dtype=np.int64)
        starts = np.zeros((len(sample_ids), self.seq_length), dtype=bool)
        if not len(sample_ids):
            return out, starts
        if self.samples_per_epoch == 0:
            raise DataError(f"{self.name} has no complete sample of {self.seq_length + 1} tokens")
        epochs = sample_ids // self.samples_per_epoch
        for epoch in np.unique(epochs):
            rows = epochs == epoch
            out[rows], starts[rows] = self._read(self._epoch(int(epoch)), sample_ids[rows] % self.samples_per_epoch)
        return out, starts

    def _read(self, epoch: _Epoch, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Gather the tokens of packed samples `slots` of one epoch (vectorised over tokens), and
        where their documents start."""
        length = self.seq_length
        positions = epoch.sample_order[slots][:, None] * length + np.arange(length + 1)
        # Which document (in epoch order) each stream position falls in, and where in it.
        in_order = np.searchsorted(epoch.stream_ends, positions, side="right")
        document = epoch.document_order[in_order]
        offset = positions - (epoch.stream_ends[in_order] - self._stream_len[document])
        doc_len = self._doc_len[document]
        tokens = self.dataset.tokens[self._doc_start[document] + np.minimum(offset, doc_len - 1)]
        tokens = tokens.astype(np.int64)
        tokens[offset >= doc_len] = self.eos_id  # the position just past a document is its eos
        return tokens, offset[:, :length] == 0


class TrainingData:
    """The training and validation streams of a run, with a resumable position.

    Built by `build_data`. The training loop calls `next_global_batch` once per step, saves
    `state_dict()` in checkpoints and calls `load_state_dict()` on resume; evaluation iterates
    `validation_batches()`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        train: list[PackedDataset],
        valid: list[PackedDataset],
        weights: np.ndarray,
        seq_length: int,
        max_epochs: int,
        vocab_size: int,
        fingerprint: dict[str, Any],
    ) -> None:
        self.tokenizer = tokenizer
        self.train = train
        self.valid = valid
        self.weights = np.asarray(weights, dtype=np.float64)
        """Normalised blending weight of every training dataset."""
        self.seq_length = seq_length
        self.max_epochs = max_epochs
        self.vocab_size = vocab_size
        self.fingerprint_fields = fingerprint
        """What the fingerprint covers, kept readable so a refused resume can say what changed."""
        self.fingerprint = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        """Digest of the data settings and files a position is only valid for."""
        self.consumed_samples = 0
        """Training samples handed out so far (all ranks together)."""
        self.document_boundaries = "none"
        """`data.document_boundaries`: with "reset", batches carry their document starts."""
        self.eod_mask_loss = False
        """`data.eod_mask_loss`: batches carry a loss mask that drops the label after an eos."""
        self._taken = np.zeros(len(train), dtype=np.int64)

    # -- training stream -------------------------------------------------------------------

    def next_global_batch(self, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> torch.Tensor:
        """This rank's rows of the next global batch: LongTensor `[global_batch_size // dp_size,
        seq_length + 1]` (inputs `[:, :-1]`, labels `[:, 1:]`). Every rank must call it every step."""
        return self.next_batch(global_batch_size, dp_rank, dp_size).tokens

    def next_batch(self, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> TokenBatch:
        """`next_global_batch` as a `TokenBatch`: with the rows' document starts when
        `data.document_boundaries` is reset, their loss mask with `data.eod_mask_loss`."""
        rows = _local_rows(global_batch_size, dp_rank, dp_size)
        dataset_ids, sample_ids, taken = greedy_blend(self.weights, self._taken, global_batch_size)
        for d, dataset in enumerate(self.train):
            mine = sample_ids[dataset_ids == d]
            if len(mine) and int(mine.max()) >= self.max_epochs * dataset.samples_per_epoch:
                raise DataError(
                    _epochs_message(
                        dataset, int(mine.max()) + 1, self.max_epochs, f"after {self.consumed_samples} samples, the run"
                    )
                )
        batch = self._token_batch(*self._gather_with_starts(self.train, dataset_ids[rows], sample_ids[rows]))
        self._taken = taken
        self.consumed_samples += global_batch_size
        return batch

    def _gather(self, datasets: list[PackedDataset], dataset_ids: np.ndarray, sample_ids: np.ndarray) -> torch.Tensor:
        """Rows of the given (dataset, sample) pairs, as one LongTensor."""
        return self._gather_with_starts(datasets, dataset_ids, sample_ids)[0]

    def _gather_with_starts(
        self, datasets: list[PackedDataset], dataset_ids: np.ndarray, sample_ids: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the given (dataset, sample) pairs, and where their documents start."""
        out = np.empty((len(dataset_ids), self.seq_length + 1), dtype=np.int64)
        starts = np.zeros((len(dataset_ids), self.seq_length), dtype=bool)
        for d in np.unique(dataset_ids):
            rows = dataset_ids == d
            tokens, starts[rows] = datasets[d].samples_with_starts(sample_ids[rows])
            if tokens.size and (int(tokens.max()) >= self.vocab_size or int(tokens.min()) < 0):
                raise DataError(_vocab_message(datasets[d].dataset, tokens, self.vocab_size, self.tokenizer))
            out[rows] = tokens
        return torch.from_numpy(out), torch.from_numpy(starts)

    def state_dict(self) -> dict[str, Any]:
        """The position in the training stream (plain Python values), with the data fingerprint."""
        return {
            "version": STATE_VERSION,
            "consumed_samples": int(self.consumed_samples),
            "taken_per_dataset": [int(x) for x in self._taken],
            "fingerprint": self.fingerprint,
            "fingerprint_fields": self.fingerprint_fields,
        }

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue from a saved position; the next batches are exactly those that came next.

        With `strict` (the default) a position saved against other data settings or files is
        refused; `strict=False` takes the position anyway (its samples then mean other tokens).
        """
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data state version {state.get('version')!r} is not {STATE_VERSION}")
        taken = np.asarray(state["taken_per_dataset"], dtype=np.int64)
        if strict and state["fingerprint"] != self.fingerprint:
            changes = _describe_changes(state.get("fingerprint_fields", {}), self.fingerprint_fields)
            raise DataError(
                "the checkpoint's data position belongs to other data: "
                f"{changes}. Resume with the same data.* settings and dataset files, or start "
                "the data position afresh (load_state_dict(state, strict=False) keeps the count)"
            )
        if len(taken) != len(self.train) or int(taken.sum()) != int(state["consumed_samples"]):
            if strict:
                raise DataError(
                    f"the checkpoint's data position has {len(taken)} dataset counts summing to "
                    f"{int(taken.sum())}, but this run blends {len(self.train)} datasets and the "
                    f"position says {state['consumed_samples']} samples"
                )
            # Non-strict resume onto other datasets: keep the count, restart the blend shares.
            taken = np.floor(self.weights * int(state["consumed_samples"])).astype(np.int64)
        self.consumed_samples = int(state["consumed_samples"])
        self._taken = taken

    # -- validation stream -----------------------------------------------------------------

    @property
    def validation_samples(self) -> int:
        """Samples in the validation split (all datasets)."""
        return sum(dataset.samples_per_epoch for dataset in self.valid)

    def num_validation_batches(self, global_batch_size: int) -> int:
        """Complete validation batches of `global_batch_size` samples (the remainder is dropped)."""
        return self.validation_samples // global_batch_size

    def validation_batches(
        self, global_batch_size: int, max_batches: int | None = None, *, dp_rank: int = 0, dp_size: int = 1
    ) -> Iterator[torch.Tensor]:
        """This rank's rows of every validation batch (at most `max_batches`), always the same
        ones in the same order: LongTensor `[global_batch_size // dp_size, seq_length + 1]`.

        The datasets are blended in proportion to their validation samples, so a truncated pass
        still sees all of them; nothing is shuffled. Yields nothing when the validation split
        cannot fill one batch (see `num_validation_batches`).
        """
        for batch in self.validation_token_batches(global_batch_size, max_batches, dp_rank=dp_rank, dp_size=dp_size):
            yield batch.tokens

    def validation_token_batches(
        self, global_batch_size: int, max_batches: int | None = None, *, dp_rank: int = 0, dp_size: int = 1
    ) -> Iterator[TokenBatch]:
        """`validation_batches` as `TokenBatch`es (document starts and loss mask as `next_batch`)."""
        rows = _local_rows(global_batch_size, dp_rank, dp_size)
        num_batches = self.num_validation_batches(global_batch_size)
        if max_batches is not None:
            num_batches = min(num_batches, max_batches)
        if not num_batches:
            return
        sizes = np.array([dataset.samples_per_epoch for dataset in self.valid], dtype=np.float64)
        weights, taken = sizes / sizes.sum(), np.zeros(len(self.valid), dtype=np.int64)
        for _ in range(num_batches):
            dataset_ids, sample_ids, taken = greedy_blend(weights, taken, global_batch_size)
            yield self._token_batch(*self._gather_with_starts(self.valid, dataset_ids[rows], sample_ids[rows]))

    def _token_batch(self, tokens: torch.Tensor, starts: torch.Tensor) -> TokenBatch:
        """The rows with what `data.document_boundaries` and `data.eod_mask_loss` ask for."""
        return token_batch(
            tokens,
            starts,
            self.tokenizer.eos_id,
            reset=self.document_boundaries == "reset",
            eod_mask_loss=self.eod_mask_loss,
        )

    def describe(self) -> str:
        """A few lines for the log: tokenizer, and per dataset its split, samples and weight."""
        lines = [
            f"data: {len(self.train)} dataset(s), tokenizer {self.tokenizer.name} "
            f"(vocab {self.tokenizer.vocab_size}, eos {self.tokenizer.eos_id}), "
            f"samples of {self.seq_length}+1 tokens"
        ]
        for train, valid, weight in zip(self.train, self.valid, self.weights):
            lines.append(
                f"  {train.name}: weight {weight:.3f}, train {train.num_documents} docs / "
                f"{train.num_tokens} tokens / {train.samples_per_epoch} samples per epoch, "
                f"validation {valid.num_documents} docs / {valid.samples_per_epoch} samples"
            )
        return "\n".join(lines)


def _local_rows(global_batch_size: int, dp_rank: int, dp_size: int) -> slice:
    """Rows `[r * G/dp, (r+1) * G/dp)` of a global batch that data-parallel rank `r` receives (the
    job's batch sizes split evenly: `TrainConfig.micro_batches_per_rank` holds that rule)."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
    local = global_batch_size // dp_size
    return slice(dp_rank * local, (dp_rank + 1) * local)


def build_data(config: DataConfig, global_batch_size: int, total_steps: int, vocab_size: int) -> TrainingData:
    """Tokenizer, datasets (or the default corpus), split, packing and blend for a run.

    Refuses, with a message naming the setting to change, data that cannot fill one global batch
    per epoch, a run of `total_steps` that would need more than `data.max_epochs` passes, and
    token ids that do not fit `vocab_size` (the model's embedding rows).
    """
    config.validate()  # the data section's own rules (a ConfigError), for configs built in code too
    if global_batch_size < 1 or total_steps < 0:
        raise ValueError(
            f"global_batch_size {global_batch_size} must be positive and total_steps {total_steps} not negative"
        )
    tokenizer = build_tokenizer(config.tokenizer, eos_token=config.eos_token)
    if tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"model.vocab_size = {vocab_size} is smaller than the vocabulary of tokenizer "
            f"{tokenizer.name!r} ({tokenizer.vocab_size} ids); raise model.vocab_size to at least "
            f"{tokenizer.vocab_size} or choose another data.tokenizer"
        )

    if config.paths:
        prefixes, names = list(config.paths), list(config.paths)
    else:
        if not isinstance(tokenizer, ByteTokenizer):
            raise DataError(
                "the embedded default corpus is byte-tokenised: with an empty data.paths keep "
                f"data.tokenizer: byte (it is {config.tokenizer!r}), or give data.paths"
            )
        prefix = default_corpus_prefix(resolve_cache_dir(config.cache_dir), config.corpus_max_bytes)
        prefixes, names = [prefix], [f"the default corpus ({prefix})"]
    datasets = [IndexedDataset(prefix) for prefix in prefixes]
    for dataset in datasets:
        _scan_vocabulary(dataset, vocab_size, tokenizer)

    train, valid = [], []
    for salt, (dataset, name) in enumerate(zip(datasets, names)):
        train_ids, valid_ids = split_documents(dataset.num_documents, config.validation_fraction)
        common = dict(seq_length=config.seq_length, eos_id=tokenizer.eos_id, seed=config.seed, salt=salt)
        train.append(PackedDataset(dataset, train_ids, shuffle=True, name=name, **common))
        valid.append(PackedDataset(dataset, valid_ids, shuffle=False, name=f"{name} (validation)", **common))

    if config.weights is None:
        raw = np.array([dataset.num_tokens for dataset in train], dtype=np.float64)
    else:
        raw = np.array(config.weights, dtype=np.float64)
    if raw.sum() <= 0:
        raise DataError("the training split of every dataset is empty; add documents or lower data.validation_fraction")
    weights = raw / raw.sum()

    _check_size(train, weights, global_batch_size, total_steps, config)

    fingerprint = {
        "seq_length": config.seq_length,
        "seed": config.seed,
        "validation_fraction": config.validation_fraction,
        "tokenizer": tokenizer.identity(),
        "datasets": [
            {
                "name": Path(dataset.prefix).name,
                "documents": dataset.num_documents,
                "tokens": dataset.num_tokens,
                "index_digest": _index_digest(dataset.idx_path),
                "weight": round(float(weight), 12),
            }
            for dataset, weight in zip(datasets, weights)
        ],
    }
    data = TrainingData(tokenizer, train, valid, weights, config.seq_length, config.max_epochs, vocab_size, fingerprint)
    data.document_boundaries, data.eod_mask_loss = config.document_boundaries, config.eod_mask_loss
    return data


def _check_size(
    train: list[PackedDataset], weights: np.ndarray, global_batch_size: int, total_steps: int, config: DataConfig
) -> None:
    """Refuse data too small for one global batch, or for the run within data.max_epochs."""
    used = [(dataset, weight) for dataset, weight in zip(train, weights) if weight > 0]
    for dataset, _ in used:
        if dataset.samples_per_epoch == 0:
            raise DataError(
                f"{dataset.name} cannot fill a single sample: its training split has "
                f"{dataset.num_tokens} tokens, and a sample needs data.seq_length + 1 = "
                f"{config.seq_length + 1}; add data, lower data.seq_length or give it weight 0"
            )
    per_epoch = sum(dataset.samples_per_epoch for dataset, _ in used)
    if per_epoch < global_batch_size:
        raise DataError(
            f"the training data cannot fill one global batch: "
            f"{', '.join(dataset.name for dataset, _ in used)} give {per_epoch} samples of "
            f"data.seq_length + 1 = {config.seq_length + 1} tokens per epoch, fewer than the "
            f"global batch of {global_batch_size}; add data (data.paths), lower data.seq_length "
            "or the global batch size"
        )
    total = total_steps * global_batch_size
    for dataset, weight in used:
        # The greedy blend keeps every share within one sample of weight * total.
        need = total if len(used) == 1 else min(total, math.ceil(weight * total) + 1)
        if need > config.max_epochs * dataset.samples_per_epoch:
            raise DataError(
                _epochs_message(
                    dataset,
                    need,
                    config.max_epochs,
                    f"train.steps = {total_steps} global batches of {global_batch_size} samples",
                )
            )


def _epochs_message(dataset: PackedDataset, need: int, max_epochs: int, who: str) -> str:
    """The 'needs more passes than data.max_epochs' refusal."""
    passes = math.ceil(need / dataset.samples_per_epoch)
    return (
        f"{who} needs {need} samples from {dataset.name}, {passes} passes over its "
        f"{dataset.samples_per_epoch} training samples per epoch, but data.max_epochs = "
        f"{max_epochs}; raise data.max_epochs to {passes}, lower train.steps, or add data"
    )


def _vocab_message(dataset: IndexedDataset, tokens: np.ndarray, vocab_size: int, tokenizer: Tokenizer) -> str:
    """The 'token id does not fit the embedding' refusal."""
    return (
        f"{dataset.bin_path} holds token ids {int(tokens.min())}..{int(tokens.max())}, outside "
        f"model.vocab_size = {vocab_size} (tokenizer {tokenizer.name!r}, {tokenizer.vocab_size} "
        "ids): it was tokenised with another vocabulary; re-run tools/preprocess_data.py with "
        "data.tokenizer, or raise model.vocab_size"
    )


def _scan_vocabulary(dataset: IndexedDataset, vocab_size: int, tokenizer: Tokenizer) -> None:
    """Check every token id of a dataset up to SCAN_LIMIT_BYTES against `vocab_size`."""
    if dataset.num_tokens == 0 or dataset.num_tokens * dataset.dtype.itemsize > SCAN_LIMIT_BYTES:
        return
    if dataset.dtype.kind == "u" and np.iinfo(dataset.dtype).max < vocab_size:
        return  # every representable id fits
    chunk = 1 << 24
    low, high = None, None
    for start in range(0, dataset.num_tokens, chunk):
        part = dataset.tokens[start : start + chunk]
        low = int(part.min()) if low is None else min(low, int(part.min()))
        high = int(part.max()) if high is None else max(high, int(part.max()))
    assert low is not None and high is not None  # num_tokens > 0: the loop ran at least once
    if high >= vocab_size or low < 0:
        raise DataError(_vocab_message(dataset, np.array([low, high]), vocab_size, tokenizer))


def _index_digest(idx_path: Path) -> str:
    """Digest of an .idx file's size, first and last MiB: cheap, and changes with the contents."""
    size = idx_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(idx_path, "rb") as stream:
        digest.update(stream.read(1 << 20))
        if size > 1 << 20:
            stream.seek(max(1 << 20, size - (1 << 20)))
            digest.update(stream.read())
    return digest.hexdigest()[:16]


def _describe_changes(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """'data.seq_length 128 -> 256, dataset 0 contents differ' from two fingerprint dicts."""
    changes = []
    for key in ("seq_length", "seed", "validation_fraction"):
        if saved.get(key) != current.get(key):
            changes.append(f"data.{key} {saved.get(key)} -> {current.get(key)}")
    if saved.get("tokenizer") != current.get("tokenizer"):
        changes.append(f"data.tokenizer {saved.get('tokenizer')} -> {current.get('tokenizer')}")
    before, after = saved.get("datasets", []), current.get("datasets", [])
    if len(before) != len(after):
        changes.append(f"{len(before)} datasets -> {len(after)}")
    else:
        for i, (old, new) in enumerate(zip(before, after)):
            if old.get("weight") != new.get("weight"):
                changes.append(f"dataset {i} weight {old.get('weight')} -> {new.get('weight')}")
            contents = [{k: v for k, v in entry.items() if k != "weight"} for entry in (old, new)]
            if contents[0] != contents[1]:
                changes.append(f"dataset {i} ({new.get('name')}) has other contents")
    return ", ".join(changes) or "the data fingerprint differs"
