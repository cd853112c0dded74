"""Megatron-core's indexed dataset (`MMIDIDX`, version 1): a streaming writer and a memmap reader.

A dataset is a pair of files sharing a prefix (docs/design.md §2.3):

`PREFIX.bin` holds the tokens of every sequence back to back, in one dtype (uint16 when the
vocabulary has fewer than 65,500 entries, else int32), with no header.

`PREFIX.idx`, little-endian throughout:

    offset       size       field
    0            9          magic b"MMIDIDX\\x00\\x00"
    9            8          version, uint64 = 1
    17           1          dtype code, uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                               6 float64, 7 float32, 8 uint16
    18           8          sequence count S, uint64
    26           8          document-index count D + 1, uint64
    34           4*S        sequence lengths (tokens), int32
    34+4S        8*S        sequence byte offsets into .bin, int64 (running sum of length * itemsize)
    34+12S       8*(D+1)    document indices, int64: 0, then the sequence count at the end of
                            each document (document d is sequences [doc[d], doc[d+1]))
    34+12S+8(D+1)  S        optional: one int8 mode per sequence (megatron's multimodal data;
                            accepted when reading, never written here)

A document is one or more consecutive sequences (megatron's `preprocess_data.py` makes one per
sentence when it splits sentences, else one per document); k3train packs whole documents.
Files written here are read by megatron-core's `IndexedDataset`, and the other way round.
"""

from __future__ import annotations

import os
import struct
import uuid
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from k3train.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
"""The first nine bytes of every `.idx` file."""
VERSION = 1
"""The only index version megatron-core (and k3train) writes."""
HEADER_BYTES = 34
"""Magic (9) + version (8) + dtype code (1) + sequence count (8) + document-index count (8)."""

DTYPE_CODES: Mapping[int, np.dtype] = MappingProxyType(
    {
        1: np.dtype(np.uint8),
        2: np.dtype(np.int8),
        3: np.dtype(np.int16),
        4: np.dtype(np.int32),
        5: np.dtype(np.int64),
        6: np.dtype(np.float64),
        7: np.dtype(np.float32),
        8: np.dtype(np.uint16),
    }
)
"""megatron-core's `DType` enum: the `.idx` dtype code of each token dtype."""

PathLike = str | os.PathLike


class DataError(UserError, ValueError):
    """Anything wrong with the data or its settings; the message names the file or key and the fix."""


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """The token dtype megatron-core picks: uint16 below 65,500 entries, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dtype_code(dtype: np.dtype) -> int:
    """The `.idx` code of a token dtype."""
    for code, candidate in DTYPE_CODES.items():
        if candidate == np.dtype(dtype):
            return code
    raise DataError(f"token dtype {np.dtype(dtype)} has no MMIDIDX code; use uint16 or int32")


def dataset_paths(prefix: PathLike) -> tuple[Path, Path]:
    """`(PREFIX.bin, PREFIX.idx)`; a prefix given with either suffix is accepted too."""
    text = os.fspath(prefix)
    if text.endswith((".bin", ".idx")):
        text = text[:-4]
    return Path(text + ".bin"), Path(text + ".idx")


class IndexedDatasetWriter:
    """Streams documents into `PREFIX.bin` / `PREFIX.idx` without holding the tokens in memory.

    Tokens go to a temporary `.bin` as they arrive; `finalize()` writes the `.idx` to a temporary
    file too and then renames both into place, so an interrupted write never leaves a dataset
    that looks complete. Use it as a context manager: leaving the block normally finalizes,
    leaving it with an exception removes the temporary files.

        with IndexedDatasetWriter("out/corpus", vocab_size=259) as writer:
            writer.add_document([1, 2, 3])
            writer.add_sequence([4, 5]); writer.add_sequence([6]); writer.end_document()
    """

    def __init__(self, prefix: PathLike, vocab_size: int | None = None, dtype: np.dtype | None = None) -> None:
        self.bin_path, self.idx_path = dataset_paths(prefix)
        self.dtype = np.dtype(dtype) if dtype is not None else optimal_dtype(vocab_size)
        self._code = dtype_code(self.dtype)
        self._limits = (np.iinfo(self.dtype).min, np.iinfo(self.dtype).max) if self.dtype.kind in "iu" else None
        # Lengths and document ends are small (12 bytes per sequence); compact arrays keep the
        # memory of a billion-document run bounded without a second pass over the tokens.
        self._lengths = array("q")
        self._document_indices = array("q", [0])
        self._num_tokens = 0
        self._finished = False
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        unique = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp_bin = self.bin_path.with_name(f".{self.bin_path.name}.tmp-{unique}")
        self._tmp_idx = self.idx_path.with_name(f".{self.idx_path.name}.tmp-{unique}")
        self._bin = open(self._tmp_bin, "wb")

    @property
    def num_sequences(self) -> int:
        """Sequences written so far."""
        return len(self._lengths)

    @property
    def num_documents(self) -> int:
        """Documents ended so far."""
        return len(self._document_indices) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens written so far."""
        return self._num_tokens

    def add_sequence(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence to the current document (end it with `end_document()`)."""
        if self._finished:
            raise RuntimeError(f"{self.bin_path}: the writer is already finalized")
        data = np.asarray(tokens)
        if data.ndim != 1:
            raise DataError(f"{self.bin_path}: a sequence must be 1-D, got shape {data.shape}")
        if data.size and self._limits is not None:
            low, high = int(data.min()), int(data.max())
            if low < self._limits[0] or high > self._limits[1]:
                raise DataError(
                    f"{self.bin_path}: token ids {low}..{high} do not fit {self.dtype}; "
                    "pass the tokenizer's vocab_size (int32 above 65,500 entries) or dtype=np.int32"
                )
        if len(data) > np.iinfo(np.int32).max:
            raise DataError(f"{self.bin_path}: one sequence may hold at most 2**31-1 tokens")
        self._bin.write(data.astype(self.dtype, copy=False).tobytes(order="C"))
        self._lengths.append(len(data))
        self._num_tokens += len(data)

    def end_document(self) -> None:
        """Close the current document (the sequences added since the last call)."""
        self._document_indices.append(len(self._lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append a document made of one sequence."""
        self.add_sequence(tokens)
        self.end_document()

    def finalize(self) -> tuple[Path, Path]:
        """Write the index and move both files into place; returns `(bin_path, idx_path)`.

        A document still open (sequences added after the last `end_document()`) is ended first.
        """
        if self._finished:
            return self.bin_path, self.idx_path
        if self._document_indices[-1] != len(self._lengths):
            self.end_document()
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            lengths = np.frombuffer(self._lengths, dtype=np.int64)
            pointers = np.zeros(len(lengths), dtype=np.int64)
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
            with open(self._tmp_idx, "wb") as idx:
                idx.write(MAGIC)
                idx.write(struct.pack("<Q", VERSION))
                idx.write(struct.pack("<B", self._code))
                idx.write(struct.pack("<Q", len(lengths)))
                idx.write(struct.pack("<Q", len(self._document_indices)))
                idx.write(lengths.astype("<i4").tobytes(order="C"))
                idx.write(pointers.astype("<i8").tobytes(order="C"))
                idx.write(np.frombuffer(self._document_indices, dtype=np.int64).astype("<i8").tobytes())
                idx.flush()
                os.fsync(idx.fileno())
            # .bin first, .idx last: a reader that finds the new .idx also finds its .bin. A
            # reader racing a rewrite of an existing pair gets the size-mismatch error, never
            # silently wrong tokens.
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(self._tmp_idx, self.idx_path)
        except BaseException:
            self.abort()
            raise
        self._finished = True
        return self.bin_path, self.idx_path

    def abort(self) -> None:
        """Drop everything written so far (the temporary files); the target paths are untouched."""
        self._finished = True
        if not self._bin.closed:
            self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def write_indexed_dataset(
    prefix: PathLike,
    documents: Sequence[Sequence[int] | np.ndarray],
    vocab_size: int | None = None,
    dtype: np.dtype | None = None,
) -> tuple[Path, Path]:
    """Write a list of documents (one sequence each) in one call; returns `(bin_path, idx_path)`."""
    with IndexedDatasetWriter(prefix, vocab_size=vocab_size, dtype=dtype) as writer:
        for document in documents:
            writer.add_document(document)
    return writer.bin_path, writer.idx_path


_REGENERATE = "regenerate it with tools/preprocess_data.py or fix data.paths"


@dataclass(frozen=True)
class IndexHeader:
    """What a `.idx` header says, checked against the two files' sizes (not yet the arrays)."""

    bin_path: Path
    idx_path: Path
    dtype: np.dtype
    sequence_count: int
    document_count: int
    idx_size: int
    arrays_end: int
    """Bytes of header + lengths + pointers + document indices (an int8 mode per sequence may follow)."""


def read_index_header(prefix: PathLike) -> IndexHeader:
    """Check that `PREFIX.bin` and `PREFIX.idx` exist and that the index header is megatron's
    MMIDIDX with sizes that fit the file, without reading the arrays (what the job checks before
    it builds the model; `IndexedDataset` then checks the arrays and the `.bin` size)."""
    bin_path, idx_path = dataset_paths(prefix)
    prefix_text = str(bin_path)[:-4]
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise DataError(
                f"{path} not found: the indexed dataset {prefix_text!r} needs both "
                f"{bin_path.name} and {idx_path.name}; {_REGENERATE}"
            )
    idx_size = idx_path.stat().st_size
    with open(idx_path, "rb") as stream:
        header = stream.read(HEADER_BYTES)
    if len(header) < 9 and MAGIC.startswith(header):
        raise DataError(
            f"{idx_path} is truncated: {len(header)} bytes, shorter than the "
            f"{HEADER_BYTES}-byte header; the write was interrupted, {_REGENERATE}"
        )
    if header[:9] != MAGIC:
        raise DataError(
            f"{idx_path} is not a megatron MMIDIDX index (first bytes {header[:9]!r}, "
            f"expected {MAGIC!r}); {_REGENERATE}"
        )
    if len(header) < HEADER_BYTES:
        raise DataError(
            f"{idx_path} is truncated: {len(header)} bytes, shorter than the "
            f"{HEADER_BYTES}-byte header; the write was interrupted, {_REGENERATE}"
        )
    (version,) = struct.unpack_from("<Q", header, 9)
    if version != VERSION:
        raise DataError(
            f"{idx_path} has index version {version}; only version {VERSION} "
            f"(megatron-core's MMIDIDX) is supported, {_REGENERATE}"
        )
    code = header[17]
    if code not in DTYPE_CODES:
        raise DataError(
            f"{idx_path} has unknown dtype code {code} (known: "
            f"{', '.join(f'{c} {d}' for c, d in DTYPE_CODES.items())}); the file is corrupt, "
            f"{_REGENERATE}"
        )
    dtype = DTYPE_CODES[code]
    sequence_count, document_count = struct.unpack_from("<QQ", header, 18)
    expected = HEADER_BYTES + 12 * sequence_count + 8 * document_count
    if idx_size < expected:
        raise DataError(
            f"{idx_path} is truncated: {idx_size} bytes, but {sequence_count} sequences "
            f"and {document_count} document indices need {expected}; the write was "
            f"interrupted, {_REGENERATE}"
        )
    if idx_size not in (expected, expected + sequence_count):
        raise DataError(
            f"{idx_path} has {idx_size - expected} unexpected bytes after the document "
            f"indices (only an optional int8 mode per sequence may follow); {_REGENERATE}"
        )
    if document_count < 1:
        raise DataError(f"{idx_path} has no document indices (needs at least [0]); {_REGENERATE}")
    return IndexHeader(bin_path, idx_path, dtype, sequence_count, document_count, idx_size, expected)


class IndexedDataset:
    """Read-only view of `PREFIX.bin` / `PREFIX.idx` (numpy memmaps, nothing loaded eagerly).

    `len(ds)` is the number of sequences, `ds.get(i)` one sequence's tokens, `ds.tokens` the
    whole `.bin` as a 1-D array, and `document_spans()` the token range of every document.
    Every inconsistency between the two files raises `DataError` naming the file.
    """

    def __init__(self, prefix: PathLike) -> None:
        header = read_index_header(prefix)
        self.bin_path, self.idx_path = header.bin_path, header.idx_path
        self.prefix = str(self.bin_path)[:-4]
        self.dtype: np.dtype = header.dtype
        sequence_count, document_count = header.sequence_count, header.document_count
        idx_size, expected = header.idx_size, header.arrays_end

        idx_map = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        offset = HEADER_BYTES
        self.sequence_lengths: np.ndarray = np.frombuffer(idx_map, "<i4", sequence_count, offset)
        offset += 4 * sequence_count
        self.sequence_pointers: np.ndarray = np.frombuffer(idx_map, "<i8", sequence_count, offset)
        offset += 8 * sequence_count
        self.document_indices: np.ndarray = np.frombuffer(idx_map, "<i8", document_count, offset)
        offset += 8 * document_count
        self.sequence_modes: np.ndarray | None = (
            np.frombuffer(idx_map, np.int8, sequence_count, offset) if idx_size > expected else None
        )
        self._check_index()

        # Token offset of every sequence: the running sum of the lengths (what the pointers say,
        # divided by the itemsize; `_check_index` holds the two together).
        self.sequence_starts = np.zeros(sequence_count + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=self.sequence_starts[1:])
        self.num_tokens = int(self.sequence_starts[-1])
        expected_bin = self.num_tokens * self.dtype.itemsize
        bin_size = self.bin_path.stat().st_size
        if bin_size != expected_bin:
            raise DataError(
                f"{self.bin_path} has {bin_size} bytes, but {self.idx_path.name} describes "
                f"{self.num_tokens} {self.dtype} tokens = {expected_bin} bytes; the .bin is "
                f"{'truncated' if bin_size < expected_bin else 'longer'} or belongs to another "
                f"index, {_REGENERATE}"
            )
        # np.memmap refuses empty files; an empty dataset gets an empty array.
        self.tokens: np.ndarray = (
            np.memmap(self.bin_path, dtype=self.dtype, mode="r") if bin_size else np.zeros(0, self.dtype)
        )

    def _check_index(self) -> None:
        """Hold the three index arrays to the format's invariants (cheap numpy checks)."""
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        problem = None
        if len(lengths) and int(lengths.min()) < 0:
            problem = "a negative sequence length"
        elif len(pointers) and (
            pointers[0] != 0
            or not np.array_equal(np.diff(pointers), lengths[:-1].astype(np.int64) * self.dtype.itemsize)
        ):
            problem = "sequence offsets that are not the running sum of the lengths"
        elif docs[0] != 0 or docs[-1] != len(lengths) or (len(docs) > 1 and np.diff(docs).min() < 0):
            problem = f"document indices that do not run from 0 to the sequence count {len(lengths)}"
        if problem:
            raise DataError(f"{self.idx_path} is corrupt: it has {problem}; {_REGENERATE}")

    def __len__(self) -> int:
        """Number of sequences (megatron-core's `len(IndexedDataset)`)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        """Number of documents."""
        return len(self.document_indices) - 1

    def get(self, sequence_index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens of one sequence (or `length` of them from `offset`), as a read-only array."""
        if not -len(self) <= sequence_index < len(self):
            raise IndexError(f"sequence {sequence_index} out of range for {len(self)} sequences")
        sequence_index %= len(self)
        start = int(self.sequence_starts[sequence_index])
        size = int(self.sequence_lengths[sequence_index])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for a sequence of {size}")
        return self.tokens[start + offset : start + offset + length]

    __getitem__ = get

    def document_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """`(starts, ends)`: token offsets of every document in `tokens` (documents are contiguous)."""
        return (
            self.sequence_starts[self.document_indices[:-1]],
            self.sequence_starts[self.document_indices[1:]],
        )

    def get_document(self, document_index: int) -> np.ndarray:
        """All tokens of one document (its sequences back to back)."""
        starts, ends = self.document_spans()
        return self.tokens[int(starts[document_index]) : int(ends[document_index])]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}: {self.num_documents} documents, {len(self)} sequences, "
            f"{self.num_tokens} {self.dtype} tokens)"
        )
