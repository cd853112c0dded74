"""The files a job's config names, checked before torch loads and the model is built.

Building a K3-sized model takes minutes (and importing torch tens of seconds on a cold disk), so
a mistyped `data.paths` entry reported only when the data is built wastes that time. These
checks read no more than a few bytes per file: both files of every indexed dataset exist and
the `.idx` header is megatron's MMIDIDX with sizes that fit (`read_index_header`; the arrays
and the `.bin` size are checked when the data is built), the tokenizer file exists, and an
explicit `checkpoint.resume` path exists. Each failure is one line naming the field, the file
and the fix (a DataError, the data errors' class). Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from k3train.config import JobConfig
from k3train.data.indexed_dataset import DataError, read_index_header
from k3train.data.tokenizers import tokenizer_file

__all__ = ["check_input_files"]

RESUME_KEYWORDS = ("", "auto", "none")
"""`checkpoint.resume` values that name no path (checkpoint/checkpointer.py `resolve_resume`)."""


def check_input_files(config: JobConfig, run_dir: str | None = None) -> None:
    """Raise DataError for the first named file that is missing or not what it should be."""
    for prefix in config.data.paths:
        read_index_header(prefix)
    if config.data.tokenizer != "byte":
        tokenizer_file(config.data.tokenizer)
    _check_resume_path(config, run_dir)


def _check_resume_path(config: JobConfig, run_dir: str | None) -> None:
    resume = str(config.checkpoint.resume).strip()
    if resume.lower() in RESUME_KEYWORDS:
        return
    path = Path(resume).expanduser()
    checkpoint_dir = config.checkpoint.dir or (str(Path(run_dir) / "checkpoints") if run_dir else None)
    below = Path(checkpoint_dir).expanduser() / path if checkpoint_dir and not path.is_absolute() else None
    if path.exists() or (below is not None and below.exists()):
        return  # what it holds is checked on load (checkpoint/verify.py)
    looked = f"{path}" + (f" or {below}" if below is not None else "")
    raise DataError(
        f"checkpoint.resume={resume}: no such checkpoint ({looked} does not exist); pass a "
        f"step_NNNNNNNN directory, checkpoint.resume=auto (the newest in checkpoint.dir) or none"
    )
