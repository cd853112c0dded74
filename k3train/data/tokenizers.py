"""Tokenizers behind one small interface: `encode`, `decode`, `eos_id`, `vocab_size`, `name`.

`ByteTokenizer` needs nothing (ids 0-255 are bytes, 256 eos, 257 bos, 258 pad); it tokenises the
embedded default corpus. `HuggingFaceTokenizer` loads any `tokenizer.json` through the Hugging
Face `tokenizers` package. `build_tokenizer("byte" | path)` picks one from `data.tokenizer`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from k3train.data.indexed_dataset import DataError

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")
"""Special tokens tried, in order, as the end-of-document token of a Hugging Face tokenizer."""


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    """Short description for messages ('byte', or the tokenizer.json path)."""
    vocab_size: int
    """Number of ids the tokenizer can produce (every id is below it)."""
    eos_id: int
    """Id appended after every document."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`."""
        ...

    def identity(self) -> str:
        """A string that changes whenever the id mapping changes (for the data fingerprint)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, plus eos = 256, bos = 257, pad = 258 (`vocab_size` 259)."""

    name = "byte"
    eos_id = 256
    bos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of the byte ids; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def identity(self) -> str:
        """Fixed: the byte mapping never changes."""
        return "byte"


class HuggingFaceTokenizer:
    """A Hugging Face `tokenizer.json`, loaded with the `tokenizers` package.

    The end-of-document id is `eos_token` when given, else the first of `EOS_CANDIDATES` the
    vocabulary has.
    """

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None) -> None:
        hf_tokenizers = _import_hf_tokenizers()
        self.path = Path(path)
        self.name = str(path)
        try:
            self._tokenizer = hf_tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as error:  # the Rust side raises a bare Exception subclass
            raise DataError(f"cannot load the tokenizer {self.path}: {error}") from error
        self.vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        candidates = (eos_token,) if eos_token is not None else EOS_CANDIDATES
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                self.eos_id = int(token_id)
                self.eos_token = token
                break
        else:
            if eos_token is not None:
                raise DataError(f"data.eos_token {eos_token!r} is not in the vocabulary of {self.path}")
            raise DataError(
                f"{self.path} has none of the usual end-of-text tokens ({', '.join(EOS_CANDIDATES)}); "
                "set data.eos_token to the token that ends a document"
            )
        # Ids can exceed the vocabulary count when a tokenizer.json skips ids; keep every id below.
        self.vocab_size = max(self.vocab_size, self.eos_id + 1)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without the tokenizer's own special tokens (eos is added by packing)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens kept."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def identity(self) -> str:
        """Digest of the tokenizer.json contents and the eos id."""
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        return f"hf:{digest}:eos={self.eos_id}"


def _import_hf_tokenizers():
    """Import the PyPI `tokenizers` package, never this module (`k3train.data.tokenizers`).

    The import is absolute, so it finds the package on sys.path; only running a file inside
    k3train/data/ as a script would put this directory first and shadow it, which we detect.
    """
    try:
        import tokenizers as hf_tokenizers
    except ImportError as error:
        raise DataError(
            "a tokenizer.json needs the Hugging Face `tokenizers` package: pip install tokenizers"
        ) from error
    if not hasattr(hf_tokenizers, "Tokenizer"):
        raise DataError(
            f"`import tokenizers` found {getattr(hf_tokenizers, '__file__', '?')}, not the Hugging "
            "Face package; run k3train from the checkout root, not from inside k3train/data/"
        )
    return hf_tokenizers


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that `spec` (not "byte") names: the file, or one in the directory."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"data.tokenizer {spec!r} is neither 'byte' nor an existing tokenizer.json file")
    return path


def build_tokenizer(spec: str, eos_token: str | None = None) -> ByteTokenizer | HuggingFaceTokenizer:
    """`"byte"` gives the byte tokenizer; anything else is read as the path of a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    return HuggingFaceTokenizer(tokenizer_file(spec), eos_token=eos_token)
