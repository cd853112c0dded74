"""Tokenizers travelling with the Hugging Face conversion (docs/hf_conversion.md, "Tokenizers").

to-hf ships what `transformers.AutoTokenizer` loads: the run's `tokenizer.json` (with the
`tokenizer_config.json` beside it, or one written here), or for k3train's byte tokenizer an
equivalent byte-level `tokenizers` model with the same ids (bytes 0-255, eos 256, bos 257,
pad 258); the special-token ids it returns go into `config.json` and `generation_config.json`.
from-hf copies the folder's tokenizer data files (never code) into `RUN_DIR/tokenizer/` with a
record of the special-token ids `config.json` declared, so a round trip writes back the same ids
and files while the run keeps the tokenizer it was imported with.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3train.checkpoint.bounded_json import json_file
from k3train.checkpoint.containment import contained
from k3train.checkpoint.hf import HFConversionError

TOKENIZER_DATA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
)
"""Tokenizer files copied between folders: data only (a tokenizer's `.py` code never travels)."""
IMPORT_RECORD = "special_tokens.json"
"""Written by from-hf into `RUN_DIR/tokenizer/`: the ids `config.json` declared and the
`data.tokenizer` value they belong to."""
RUN_TOKENIZER_DIR = "tokenizer"
BYTE_TOKENS = {"eos_token": "<|endoftext|>", "bos_token": "<|begin_of_text|>", "pad_token": "<|pad|>"}
"""Names of the byte tokenizer's special ids in its exported form (ids from `ByteTokenizer`)."""
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]", "<|im_start|>")
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")
_JSON_MAX_BYTES = 64 << 20
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class SpecialTokens:
    """bos/eos/pad ids (None: the tokenizer has none or it is unknown). `eos_token_id` may be a
    list, as transformers allows (generation stops at any of them)."""

    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in ID_KEYS}

    def within(self, vocab_size: int) -> SpecialTokens:
        """The ids the model's vocabulary holds; an id outside it becomes None (transformers
        sizes the embedding's padding index from pad_token_id and refuses one out of range)."""

        def keep(value: Any) -> Any:
            if isinstance(value, list):
                kept = [v for v in value if 0 <= v < vocab_size]
                return kept or None
            return value if value is not None and 0 <= value < vocab_size else None

        return SpecialTokens(*(keep(getattr(self, key)) for key in ID_KEYS))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], source: str) -> SpecialTokens:
        """The ids of a `config.json`-like mapping; a value that is no id is refused in one line."""
        ids: dict[str, Any] = {}
        for key in ID_KEYS:
            value = values.get(key)
            ok = (
                value is None
                or _is_id(value)
                or (key == "eos_token_id" and isinstance(value, list) and value and all(_is_id(v) for v in value))
            )
            if not ok:
                raise HFConversionError(
                    f"{source}: {key} must be a token id (a non-negative integer) or null, got {value!r}"
                )
            ids[key] = list(value) if isinstance(value, list) else value
        return cls(**ids)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ============================================================================ the byte tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table, which `tokenizers`' ByteLevel pre-tokenizer and
    decoder use: printable Latin-1 bytes stand for themselves, the rest map to 256 + n."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> str:
    """k3train's byte tokenizer as a `tokenizer.json`: a byte-level BPE with no merges, so each
    UTF-8 byte b is token b, and eos/bos/pad at ByteTokenizer's ids as special tokens."""
    from k3train.data.tokenizers import ByteTokenizer, _import_hf_tokenizers

    hf_tokenizers = _import_hf_tokenizers()
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = hf_tokenizers.decoders.ByteLevel()
    by_id = {
        ByteTokenizer.eos_id: BYTE_TOKENS["eos_token"],
        ByteTokenizer.bos_id: BYTE_TOKENS["bos_token"],
        ByteTokenizer.pad_id: BYTE_TOKENS["pad_token"],
    }
    tokenizer.add_special_tokens([hf_tokenizers.AddedToken(by_id[i], special=True) for i in sorted(by_id)])
    for token_id, token in by_id.items():  # added in id order after the 256 bytes: check, not assume
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    return tokenizer.to_str()


def byte_special_tokens() -> SpecialTokens:
    from k3train.data.tokenizers import ByteTokenizer

    return SpecialTokens(ByteTokenizer.bos_id, ByteTokenizer.eos_id, ByteTokenizer.pad_id)


def _tokenizer_config(tokens: Mapping[str, str | None]) -> dict[str, Any]:
    """A `tokenizer_config.json` for a bare `tokenizer.json` (transformers' fast tokenizer class)."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config.update({key: value for key, value in tokens.items() if value is not None})
    return config


# ============================================================================ to-hf


@dataclass(frozen=True)
class ExportedTokenizer:
    ids: SpecialTokens
    description: str
    """One line for the tool's output: what was shipped."""


def _token_string(value: Any) -> str | None:
    """A tokenizer_config.json token entry: a string or an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json_file(path, _JSON_MAX_BYTES)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise HFConversionError(f"{path} is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise HFConversionError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value


def _copy_data_files(source_dir: Path, out: Path, names: tuple[str, ...] = TOKENIZER_DATA_FILES) -> list[str]:
    copied = []
    for name in names:
        source = contained(source_dir, name, HFConversionError)
        if source.is_file():
            shutil.copyfile(source, out / name)
            copied.append(name)
    return copied


def _vocabulary(path: Path, shown: Path | None = None) -> Any:
    """The `tokenizers.Tokenizer` of a tokenizer.json (one line naming `shown` if it cannot load)."""
    from k3train.data.tokenizers import _import_hf_tokenizers

    try:
        return _import_hf_tokenizers().Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a bare Exception subclass
        raise HFConversionError(f"{shown or path} cannot be loaded as a tokenizer: {error}") from None


def _data_files(folder: Path) -> list[str]:
    return [name for name in TOKENIZER_DATA_FILES if (folder / name).is_file()]


def _import_record(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / RUN_TOKENIZER_DIR / IMPORT_RECORD
    return _read_json(path) if path.is_file() else None


def export_tokenizer(data_tokenizer: str, eos_token: str | None, run_dir: Path, out: Path) -> ExportedTokenizer:
    """Write the run's tokenizer into the export folder `out`; return its special-token ids.

    `run_dir` holds the run's config.yaml (and, for an imported run, `tokenizer/` with from-hf's
    record: while `data.tokenizer` is still the value from-hf set, the imported ids and files are
    written back unchanged)."""
    record = _import_record(run_dir)
    if record is not None and record.get("data.tokenizer") == data_tokenizer:
        ids = SpecialTokens.from_mapping(record, str(run_dir / RUN_TOKENIZER_DIR / IMPORT_RECORD))
        # an imported byte-tokenizer model without tokenizer files (saved by save_pretrained of
        # the model alone) gets the byte tokenizer back; any other ids are written as imported
        if not (
            data_tokenizer == "byte" and ids == byte_special_tokens() and not _data_files(run_dir / RUN_TOKENIZER_DIR)
        ):
            copied = _copy_data_files(run_dir / RUN_TOKENIZER_DIR, out)
            what = ", ".join(copied) if copied else "no tokenizer files (the imported folder had none)"
            return ExportedTokenizer(ids, f"the imported tokenizer: {what}")
    if data_tokenizer == "byte":
        (out / "tokenizer.json").write_text(byte_tokenizer_json(), encoding="utf-8")
        _write_json(out / "tokenizer_config.json", _tokenizer_config(BYTE_TOKENS))
        return ExportedTokenizer(byte_special_tokens(), "the byte tokenizer as tokenizer.json + tokenizer_config.json")
    return _export_tokenizer_json(data_tokenizer, eos_token, out)


def _export_tokenizer_json(data_tokenizer: str, eos_token: str | None, out: Path) -> ExportedTokenizer:
    from k3train.data.indexed_dataset import DataError
    from k3train.data.tokenizers import HuggingFaceTokenizer, tokenizer_file

    try:
        source = tokenizer_file(data_tokenizer)
        tokenizer = HuggingFaceTokenizer(source, eos_token=eos_token)
    except DataError as error:
        raise HFConversionError(f"the run's data.tokenizer cannot be exported: {error}") from None
    vocabulary = _vocabulary(source)  # for token ↔ id look-ups
    beside = source.parent / "tokenizer_config.json"
    config = _read_json(beside) if source.name == "tokenizer.json" and beside.is_file() else None
    names: dict[str, str | None] = {"eos_token": tokenizer.eos_token, "bos_token": None, "pad_token": None}
    for key, candidates in (("bos_token", BOS_CANDIDATES), ("pad_token", PAD_CANDIDATES)):
        named = _token_string(config.get(key)) if config is not None else None
        if named is None:
            named = next((c for c in candidates if vocabulary.token_to_id(c) is not None), None)
        names[key] = named if named is not None and vocabulary.token_to_id(named) is not None else None

    def token_id(name: str | None) -> int | None:
        return None if name is None else int(vocabulary.token_to_id(name))

    ids = SpecialTokens(token_id(names["bos_token"]), tokenizer.eos_id, token_id(names["pad_token"]))
    shutil.copyfile(source, out / "tokenizer.json")
    if config is not None:
        copied = [
            "tokenizer.json",
            *_copy_data_files(source.parent, out, ("tokenizer_config.json", "special_tokens_map.json")),
        ]
    else:
        _write_json(out / "tokenizer_config.json", _tokenizer_config(names))
        copied = ["tokenizer.json", "tokenizer_config.json (written)"]
    return ExportedTokenizer(ids, f"{source}: {', '.join(copied)}")


def generation_config(ids: SpecialTokens) -> dict[str, Any]:
    """`generation_config.json`: the special ids generate() stops at and pads with."""
    return {**ids.as_dict(), "_from_model_config": True}


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


# ============================================================================ from-hf


@dataclass(frozen=True)
class ImportedTokenizer:
    data_tokenizer: str
    """The value for the run's `data.tokenizer`."""
    eos_token: str | None
    """The value for `data.eos_token` (the token of the model's eos id), None to keep the default."""
    description: str


def import_tokenizer(hf_dir: Path, ids: SpecialTokens, run_dir: Path) -> ImportedTokenizer:
    """Copy the HF folder's tokenizer data files into `run_dir/tokenizer/` with the record of
    `ids`; the run's tokenizer is its `tokenizer.json`, or the byte tokenizer without one."""
    target = run_dir / RUN_TOKENIZER_DIR
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    copied = _copy_data_files(hf_dir, target)
    eos_token = None
    is_byte = (
        "tokenizer.json" in copied and (target / "tokenizer.json").read_text(encoding="utf-8") == byte_tokenizer_json()
    )
    if is_byte and ids == byte_special_tokens():  # k3train's own byte tokenizer, exported: train with it
        data_tokenizer = "byte"
        description = f"{', '.join(copied)}: k3train's byte tokenizer (data.tokenizer = byte)"
    elif "tokenizer.json" in copied:
        data_tokenizer = str((target / "tokenizer.json").resolve())
        vocabulary = _vocabulary(Path(data_tokenizer), shown=hf_dir / "tokenizer.json")
        eos_id = ids.eos_token_id[0] if isinstance(ids.eos_token_id, list) else ids.eos_token_id
        eos_token = vocabulary.id_to_token(eos_id) if eos_id is not None else None
        description = f"{', '.join(copied)} (data.tokenizer = {data_tokenizer})"
    else:
        data_tokenizer = "byte"
        description = (
            f"{hf_dir} has no tokenizer.json: data.tokenizer stays 'byte' (set it to the model's tokenizer.json "
            "to train on its ids); to-hf writes the imported special-token ids back"
            + (f"; copied {', '.join(copied)}" if copied else "")
        )
    _write_json(target / IMPORT_RECORD, {"data.tokenizer": data_tokenizer, **ids.as_dict()})
    return ImportedTokenizer(data_tokenizer, eos_token, description)
