"""Damaged data files: a truncated `.bin` or `.idx` ends the job with one line naming the file
(before any step or checkpoint), at every cut point of the index."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from tests.faults.harness import CHECKOUT, complete_checkpoints, single

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("data")
    text = root / "corpus.txt"
    text.write_text("\n\n".join(" ".join(f"word{(i * 7 + j) % 13}" for j in range(150)) for i in range(40)))
    subprocess.run(
        [
            sys.executable,
            str(CHECKOUT / "tools/preprocess_data.py"),
            "--input",
            str(text),
            "--output-prefix",
            str(root / "corpus"),
            "--txt-documents",
            "paragraph",
        ],
        check=True,
        capture_output=True,
        timeout=120,
        cwd=CHECKOUT,
    )
    return root / "corpus"


def truncated_copy(corpus: pathlib.Path, suffix: str, keep_bytes: int, name: str) -> pathlib.Path:
    prefix = corpus.parent / name
    for part in (".bin", ".idx"):
        data = corpus.with_suffix(part).read_bytes()
        prefix.with_suffix(part).write_bytes(data[:keep_bytes] if part == suffix else data)
    return prefix


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_truncated_file_is_one_line_naming_it(tmp_path, corpus, suffix):
    size = corpus.with_suffix(suffix).stat().st_size
    prefix = truncated_copy(corpus, suffix, size // 2, f"cut{suffix[1:]}")
    run_dir = tmp_path / f"cut{suffix[1:]}"
    job = single(run_dir, f"data.paths=[{prefix}]")
    assert job.finish() == 2, job.stderr[-3000:]
    lines = job.error_lines()
    assert len(lines) == 1 and "Traceback" not in job.stderr, job.stderr[-3000:]
    assert str(prefix.with_suffix(suffix)) in lines[0] and "truncated" in lines[0], lines[0]
    assert "step 1/" not in job.stdout and complete_checkpoints(run_dir) == []


def test_every_cut_of_the_index_is_refused_with_the_file_named(tmp_path, corpus):
    """In-process, every truncation point of the `.idx` (the header, the sizes, the pointers, the
    document indices): a DataError naming the file, never another exception."""
    from k3train.data.indexed_dataset import DataError, IndexedDataset

    size = corpus.with_suffix(".idx").stat().st_size
    for keep in sorted({0, 1, 8, 9, 17, 18, 33, 34, size // 3, size // 2, size - 8, size - 1}):
        prefix = truncated_copy(corpus, ".idx", keep, f"idx{keep}")
        with pytest.raises(DataError, match=str(prefix.with_suffix(".idx")).replace(".", r"\.")):
            IndexedDataset(prefix)


@pytest.mark.parametrize("case", ["missing", "no .bin", "not an index", "tokenizer", "resume"])
def test_named_files_are_checked_before_torch_and_the_model(tmp_path, corpus, case):
    """A wrong path is one line within the second the job starts: before the parallel state
    (the first stdout line needs torch) and the model build."""
    prefix = tmp_path / "data"
    overrides = [f"data.paths=[{prefix}]"]
    if case == "no .bin":
        prefix.with_suffix(".idx").write_bytes(corpus.with_suffix(".idx").read_bytes())
    elif case == "not an index":
        prefix.with_suffix(".bin").write_bytes(corpus.with_suffix(".bin").read_bytes())
        prefix.with_suffix(".idx").write_text("not an index")
    elif case == "tokenizer":
        overrides = [f"data.tokenizer={tmp_path / 'tokenizer.json'}"]
    elif case == "resume":
        overrides = [f"checkpoint.resume={tmp_path / 'step_00000004'}"]
    expected = {
        "missing": f"{prefix}.idx not found",
        "no .bin": f"{prefix}.bin not found",
        "not an index": "is not a megatron MMIDIDX index",
        "tokenizer": "data.tokenizer",
        "resume": "checkpoint.resume=",
    }[case]
    job = single(tmp_path / "run", *overrides)
    assert job.finish() == 2, job.stderr[-3000:]
    lines = [line for line in job.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], job.stderr[-3000:]
    assert job.stdout == "", job.stdout[-2000:]  # nothing of the parallel state, the model or the data
