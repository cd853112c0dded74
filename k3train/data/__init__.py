"""Indexed datasets (.bin/.idx), tokenizers, the embedded corpus, packing, blending and the resumable sampler."""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3train.lazy_exports import lazy_exports

if TYPE_CHECKING:  # static tools and IDEs see the real imports
    from k3train.data.config import DataConfig
    from k3train.data.corpus import default_corpus_prefix, resolve_cache_dir
    from k3train.data.indexed_dataset import (
        DataError,
        IndexedDataset,
        IndexedDatasetWriter,
        optimal_dtype,
        write_indexed_dataset,
    )
    from k3train.data.samples import PackedDataset, TrainingData, build_data, greedy_blend, split_documents
    from k3train.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer, Tokenizer, build_tokenizer

# Each name loads its submodule on first use, so that importing `k3train.data.config` (as the
# torch-free config loader does) does not import torch through this package.
_SUBMODULE_OF = {
    "ByteTokenizer": "k3train.data.tokenizers",
    "DataConfig": "k3train.data.config",
    "DataError": "k3train.data.indexed_dataset",
    "HuggingFaceTokenizer": "k3train.data.tokenizers",
    "IndexedDataset": "k3train.data.indexed_dataset",
    "IndexedDatasetWriter": "k3train.data.indexed_dataset",
    "PackedDataset": "k3train.data.samples",
    "Tokenizer": "k3train.data.tokenizers",
    "TrainingData": "k3train.data.samples",
    "build_data": "k3train.data.samples",
    "build_tokenizer": "k3train.data.tokenizers",
    "default_corpus_prefix": "k3train.data.corpus",
    "greedy_blend": "k3train.data.samples",
    "optimal_dtype": "k3train.data.indexed_dataset",
    "resolve_cache_dir": "k3train.data.corpus",
    "split_documents": "k3train.data.samples",
    "write_indexed_dataset": "k3train.data.indexed_dataset",
}

__all__ = [
    "ByteTokenizer",
    "DataConfig",
    "DataError",
    "HuggingFaceTokenizer",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "PackedDataset",
    "Tokenizer",
    "TrainingData",
    "build_data",
    "build_tokenizer",
    "default_corpus_prefix",
    "greedy_blend",
    "optimal_dtype",
    "resolve_cache_dir",
    "split_documents",
    "write_indexed_dataset",
]


__getattr__, __dir__ = lazy_exports(__name__, _SUBMODULE_OF)
