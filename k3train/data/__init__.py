"""Indexed datasets (.bin/.idx), tokenizers, the embedded corpus, packing, blending and the resumable sampler."""

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
