"""Data settings (the `data:` section of a recipe)."""

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class DataConfig:
    """Where tokens come from and how they are packed into samples."""

    paths: list[str] = field(default_factory=list)
    """Indexed-dataset prefixes (PREFIX.bin + PREFIX.idx); empty means the embedded default corpus."""
    weights: Optional[list[float]] = None
    """Blending weights, one per path; null means proportional to each dataset's token count."""
    tokenizer: str = "byte"
    """'byte' (built in, no download) or the path of a Hugging Face tokenizer.json."""
    eos_token: Optional[str] = None
    """End-of-document token of a Hugging Face tokenizer; null picks the usual one (<|endoftext|>, </s>, ...)."""
    seq_length: int = 128
    """Tokens per training sample (each sample carries one more token for the shifted labels)."""
    validation_fraction: float = 0.02
    """Fraction of each dataset's documents held out for validation."""
    seed: int = 1234
    """Seed of the deterministic sample shuffle."""
    max_epochs: int = 1
    """How many passes over the data a run may make before it is refused as too small."""
    cache_dir: Optional[str] = None
    """Where the embedded default corpus is built and kept; null means $K3TRAIN_CACHE, else ~/.cache/k3train."""
    corpus_max_bytes: int = 8_000_000
    """Size cap in bytes of the embedded default corpus (Python standard-library sources; used when paths is empty)."""
