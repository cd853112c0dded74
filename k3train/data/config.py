"""Data settings (the `data:` section of a recipe)."""

import math
from dataclasses import dataclass, field
from typing import Literal

from k3train.config.recipe import check

DOCUMENT_BOUNDARIES = ("none", "reset")
"""The values of `data.document_boundaries`."""


@dataclass
class DataConfig:
    """Where tokens come from and how they are packed into samples."""

    paths: list[str] = field(default_factory=list)
    """Indexed-dataset prefixes (PREFIX.bin + PREFIX.idx); empty means the embedded default corpus."""
    weights: list[float] | None = None
    """Blending weights, one per path; null means proportional to each dataset's token count."""
    tokenizer: str = "byte"
    """'byte' (built in, no download) or the path of a Hugging Face tokenizer.json."""
    eos_token: str | None = None
    """End-of-document token of a Hugging Face tokenizer; null picks the usual one (<|endoftext|>, </s>, ...)."""
    seq_length: int = 128
    """Tokens per training sample (each sample carries one more token for the shifted labels)."""
    validation_fraction: float = 0.02
    """Fraction of each dataset's documents held out for validation."""
    seed: int = 1234
    """Seed of the deterministic sample shuffle."""
    max_epochs: int = 1
    """How many passes over the data a run may make before it is refused as too small."""
    cache_dir: str | None = None
    """Where the embedded default corpus is built and kept; null means k3train's cache: $K3TRAIN_CACHE_DIR, else
    $XDG_CACHE_HOME/k3train, else ~/.cache/k3train."""
    corpus_max_bytes: int = 8_000_000
    """Size cap in bytes of the embedded default corpus (Python standard-library sources; used when paths is empty)."""
    document_boundaries: Literal["none", "reset"] = "none"
    """'none': a packed sample is one stream (KDA's state and MLA's attention run across documents); 'reset': each
    document starts afresh (KDA state and convolution tails reset, MLA attends within the document only)."""
    eod_mask_loss: bool = False
    """Drop the loss on the token after every end-of-document token (predicting the next document's first token)."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting that cannot mean anything."""
        check(
            [
                (self.seq_length >= 1, f"data.seq_length must be at least 1, got {self.seq_length}"),
                (self.max_epochs >= 1, f"data.max_epochs must be at least 1, got {self.max_epochs}"),
                (
                    self.document_boundaries in DOCUMENT_BOUNDARIES,
                    f"data.document_boundaries must be one of {', '.join(DOCUMENT_BOUNDARIES)}, "
                    f"got {self.document_boundaries!r}",
                ),
                (
                    self.corpus_max_bytes >= 1,
                    f"data.corpus_max_bytes must be at least 1, got {self.corpus_max_bytes}",
                ),
                (
                    0.0 <= self.validation_fraction < 1.0,
                    f"data.validation_fraction must be in [0, 1), got {self.validation_fraction}",
                ),
            ]
        )
        if self.weights is not None:
            check(
                [
                    (
                        len(self.weights) == len(self.paths),
                        f"data.weights has {len(self.weights)} entries but data.paths has {len(self.paths)}; "
                        f"give one weight per path, or null",
                    ),
                    (
                        all(w >= 0 and math.isfinite(w) for w in self.weights) and sum(self.weights) > 0,
                        f"data.weights {self.weights} must be non-negative with a positive sum",
                    ),
                ]
            )
