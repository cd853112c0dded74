"""The embedded default corpus: Python's own standard-library sources, so a fresh machine trains
without downloading anything.

On first use the `*.py` files under `sysconfig.get_paths()["stdlib"]` (sorted, test directories
and site-packages skipped, at most `max_bytes` in all) become one document each, byte-tokenised
with an eos after every document, and are written as an indexed dataset into
`<cache>/corpus/<name>/corpus.{bin,idx}`. The name holds a digest of the file list, so another
Python version or cap gets its own entry, and later runs reuse it.

The whole directory is built under a temporary name and renamed into place in one step, so two
processes building at once (every rank of a torchrun job on a fresh machine) or a crash halfway
never leave a broken cache: the loser of a race discards its copy and uses the winner's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import numpy as np

from k3train.cache import cache_dir as shared_cache_dir
from k3train.data.indexed_dataset import DataError, IndexedDataset, IndexedDatasetWriter
from k3train.data.tokenizers import ByteTokenizer

DEFAULT_CORPUS_BYTES = 8_000_000
"""Default cap of the corpus: about 8 MB of source, a few seconds to build."""
SKIPPED_DIRECTORIES = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
"""Directory names whose files stay out of the corpus (test data is noisy and large)."""
CORPUS_FORMAT = 1
"""Bumped whenever the way the corpus is built changes, so old caches are not reused."""


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """`data.cache_dir` if set, else k3train's cache (`$K3TRAIN_CACHE_DIR`, ...: k3train/cache.py)."""
    return shared_cache_dir(cache_dir)


def stdlib_source_files(max_bytes: int, root: Path | None = None) -> list[tuple[Path, int]]:
    """`(path, size)` of the standard-library sources that make up the corpus, in corpus order.

    Files are visited in sorted relative-path order; one that would push the total past
    `max_bytes` is skipped (later, smaller ones may still fit), so the cap is never exceeded.
    """
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    candidates = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [name for name in subdirectories if name not in SKIPPED_DIRECTORIES]
        for name in files:
            if name.endswith(".py"):
                path = Path(directory) / name
                candidates.append((path.relative_to(root).as_posix(), path))
    chosen, total = [], 0
    for _, path in sorted(candidates):
        size = path.stat().st_size
        if size and total + size <= max_bytes:
            chosen.append((path, size))
            total += size
    return chosen


def default_corpus_prefix(cache_dir: str | os.PathLike | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> str:
    """The indexed-dataset prefix of the default corpus, building it on first use."""
    root = resolve_cache_dir(cache_dir) / "corpus"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files(max_bytes, stdlib)
    if not files:
        raise DataError(
            f"no Python sources found under {stdlib} for the default corpus; "
            "set data.paths to an indexed dataset (see tools/preprocess_data.py)"
        )
    listing = "\n".join(f"{path.relative_to(stdlib).as_posix()} {size}" for path, size in files)
    digest = hashlib.sha256(f"{CORPUS_FORMAT}\n{max_bytes}\n{listing}".encode()).hexdigest()[:12]
    name = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-{digest}"
    final = root / name
    if _is_complete(final):
        return str(final / "corpus")
    if final.exists() and not _is_complete(final):  # re-checked: another process may have just won
        # Damaged after the fact (this module only ever renames complete copies into place):
        # move it aside atomically, then delete it, and build afresh.
        trash = root / f".{name}.broken-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(final, trash)
        except OSError:
            pass  # someone else moved it already
        shutil.rmtree(trash, ignore_errors=True)

    root.mkdir(parents=True, exist_ok=True)
    scratch = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    # A first run spends seconds here (longer on a slow disk) before any other output: say so.
    started = time.perf_counter()
    print(
        f"building the default corpus (first use): {len(files)} standard-library files, "
        f"{sum(size for _, size in files) / 1e6:.1f} MB, into {final}",
        flush=True,
    )
    try:
        documents, tokens = _write_corpus(scratch, stdlib, files)
        print(
            f"built the default corpus in {time.perf_counter() - started:.1f} s: {documents:,} documents, "
            f"{tokens:,} tokens (reused by later runs)",
            flush=True,
        )
        try:
            os.rename(scratch, final)
        except OSError:
            # Another process finished first (rename onto a non-empty directory fails):
            # its copy is identical, keep it.
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(final / "corpus")


def _write_corpus(directory: Path, stdlib: Path, files: list[tuple[Path, int]]) -> tuple[int, int]:
    """Tokenise `files` (one document each, eos appended) into `directory/corpus.{bin,idx}`;
    returns the documents and tokens written."""
    tokenizer = ByteTokenizer()
    eos = np.array([tokenizer.eos_id], dtype=np.uint16)
    with IndexedDatasetWriter(directory / "corpus", vocab_size=tokenizer.vocab_size) as writer:
        for path, _ in files:
            # Raw bytes are exactly the byte tokenizer's ids; no decode/encode round trip needed.
            data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
            writer.add_document(np.concatenate([data.astype(np.uint16), eos]))
    manifest = {
        "format": CORPUS_FORMAT,
        "python": sys.version,
        "stdlib": str(stdlib),
        "tokenizer": tokenizer.name,
        "documents": writer.num_documents,
        "tokens": writer.num_tokens,
        "files": [path.relative_to(stdlib).as_posix() for path, _ in files],
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return writer.num_documents, writer.num_tokens


def _is_complete(directory: Path) -> bool:
    """Whether `directory` holds a readable corpus (renamed into place only once complete)."""
    if not (directory / "manifest.json").is_file():
        return False
    try:
        IndexedDataset(directory / "corpus")
    except DataError:
        return False
    return True
