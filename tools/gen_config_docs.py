#!/usr/bin/env python
"""Regenerate docs/config.md, the reference of every config field, from the dataclasses.

    python tools/gen_config_docs.py           # rewrite docs/config.md
    python tools/gen_config_docs.py --check   # exit 1 if docs/config.md is out of date

The same text is what `pretrain_k3.py --help-config` prints.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

CHECKOUT = pathlib.Path(__file__).resolve().parents[1]

from k3train.config.reference import config_reference_markdown  # noqa: E402

DOC_PATH = CHECKOUT / "docs" / "config.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the file differs")
    args = parser.parse_args(argv)
    text = config_reference_markdown()
    if args.check:
        current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else None
        if current != text:
            print(
                f"{DOC_PATH.relative_to(CHECKOUT)} is out of date; run python tools/gen_config_docs.py", file=sys.stderr
            )
            return 1
        return 0
    DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {DOC_PATH.relative_to(CHECKOUT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
