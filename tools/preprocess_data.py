#!/usr/bin/env python
"""Tokenise text into a megatron-core indexed dataset (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus
    python tools/preprocess_data.py --input a.txt b.txt --output-prefix data/books \\
        --tokenizer path/to/tokenizer.json --txt-documents paragraph

Inputs ending in .jsonl or .json are JSON Lines: one document per line, its text under
`--json-key` (default "text"). Any other input is plain UTF-8 text, by default one document per
file (`--txt-documents file`; the file is stored as several sequences of whole paragraphs so a
large file never sits in memory), or one document per blank-line-separated paragraph
(`--txt-documents paragraph`). An eos token ends every document unless `--no-append-eos`.
The result is what `data.paths` takes, and megatron-core's `IndexedDataset` reads it too.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Iterator

from k3train.path_arguments import PathArgument, exit_if_a_path_is_missing

PATH_ARGUMENTS = (
    PathArgument("--input", "pass existing .txt or .jsonl files", several=True),
    PathArgument("--tokenizer", "pass 'byte' or the path of a tokenizer.json", not_paths=frozenset({"byte"})),
)
if __name__ == "__main__":  # before numpy and the tokenizer load: a wrong path answers at once
    exit_if_a_path_is_missing(sys.argv[1:], PATH_ARGUMENTS, prefix="preprocess_data: ")

from tqdm import tqdm  # noqa: E402

from k3train.data.indexed_dataset import DataError, IndexedDatasetWriter  # noqa: E402
from k3train.data.tokenizers import build_tokenizer  # noqa: E402

CHUNK_CHARS = 1 << 20
"""In file mode, paragraphs are gathered into sequences of about this many characters."""


def paragraphs(path: pathlib.Path, progress: tqdm) -> Iterator[str]:
    """Blank-line-separated paragraphs of a text file, each with its trailing blank lines, so
    that joining them gives the file back."""
    block: list[str] = []
    with open(path, "rb") as stream:
        for raw in stream:
            progress.update(len(raw))
            line = raw.decode("utf-8", errors="replace")
            if not line.strip() and block and block[-1].strip():
                block.append(line)
                continue
            if line.strip() and block and not block[-1].strip():
                yield "".join(block)
                block = []
            block.append(line)
    if block:
        yield "".join(block)


def jsonl_documents(path: pathlib.Path, key: str, progress: tqdm) -> Iterator[str]:
    """The `key` field of every non-empty line of a JSON Lines file."""
    with open(path, "rb") as stream:
        for number, raw in enumerate(stream, start=1):
            progress.update(len(raw))
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{number}: not valid JSON ({error})") from error
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                raise DataError(f"{path}:{number}: no string field {key!r}; pick the field with --json-key")
            yield record[key]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input", nargs="+", required=True, type=pathlib.Path, help=".txt (or any text) and .jsonl/.json files"
    )
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or the path of a tokenizer.json")
    parser.add_argument(
        "--eos-token", default=None, help="end-of-document token of a tokenizer.json (default: detected)"
    )
    parser.add_argument("--json-key", default="text", help="field holding the text in JSON Lines")
    parser.add_argument(
        "--append-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="end every document with the eos token (default: on)",
    )
    parser.add_argument(
        "--txt-documents",
        choices=("file", "paragraph"),
        default="file",
        help="plain text: one document per file (default) or per blank-line-separated paragraph",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    try:
        for path in args.input:
            if not path.is_file():
                raise DataError(f"--input {path} does not exist; pass existing .txt or .jsonl files")
        tokenizer = build_tokenizer(args.tokenizer, eos_token=args.eos_token)
        total_bytes = sum(path.stat().st_size for path in args.input)
        progress = tqdm(
            total=total_bytes, unit="B", unit_scale=True, desc="tokenising", disable=args.quiet, file=sys.stderr
        )
        eos = [tokenizer.eos_id] if args.append_eos else []
        with progress, IndexedDatasetWriter(args.output_prefix, vocab_size=tokenizer.vocab_size) as writer:
            for path in args.input:
                if path.suffix in (".jsonl", ".json"):
                    for text in jsonl_documents(path, args.json_key, progress):
                        writer.add_document(tokenizer.encode(text) + eos)
                elif args.txt_documents == "paragraph":
                    for text in paragraphs(path, progress):
                        if text.strip():
                            writer.add_document(tokenizer.encode(text.strip("\r\n")) + eos)
                else:
                    _add_text_file(writer, tokenizer, path, eos, progress)
    except DataError as error:
        print(f"preprocess_data: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # e.g. an output prefix under a file, a full disk, no permission
        where = error.filename or args.output_prefix
        print(
            f"preprocess_data: cannot write {where} ({error.strerror or error}); "
            f"choose a --output-prefix in a writable directory",
            file=sys.stderr,
        )
        return 2

    itemsize = writer.dtype.itemsize
    print(
        f"preprocess_data: {writer.num_documents:,} documents, {writer.num_tokens:,} tokens "
        f"({writer.dtype}, tokenizer {tokenizer.name}, vocab {tokenizer.vocab_size}) "
        f"from {len(args.input)} input file(s)"
    )
    print(f"  wrote {writer.bin_path} ({writer.num_tokens * itemsize:,} bytes)")
    print(f"  wrote {writer.idx_path} ({os.path.getsize(writer.idx_path):,} bytes)")
    return 0


def _add_text_file(writer: IndexedDatasetWriter, tokenizer, path: pathlib.Path, eos: list[int], progress: tqdm) -> None:
    """One document per file: paragraphs gathered into sequences of about CHUNK_CHARS, so the
    file streams through. Cuts fall after a paragraph's blank lines, where a subword tokenizer
    could at most split the whitespace differently from one pass over the whole file."""
    pending: list[str] = []
    size = 0
    wrote = False
    for paragraph in paragraphs(path, progress):
        pending.append(paragraph)
        size += len(paragraph)
        if size >= CHUNK_CHARS:
            writer.add_sequence(tokenizer.encode("".join(pending)))
            pending, size, wrote = [], 0, True
    if pending or eos or not wrote:
        writer.add_sequence(tokenizer.encode("".join(pending)) + eos)
    writer.end_document()


if __name__ == "__main__":
    raise SystemExit(main())
