"""The tools check the paths they are given before importing torch (k3train/path_arguments.py):
one line naming the option, the path and the fix, status 2, torch never loaded."""

import subprocess
import sys
from pathlib import Path

import pytest

from k3train.path_arguments import PathArgument, missing_path

CHECKOUT = Path(__file__).resolve().parents[2]


def test_option_forms_subcommands_and_exceptions(tmp_path):
    present = tmp_path / "here"
    present.mkdir()
    arguments = [
        PathArgument("--load", "pass X", subcommand="to-hf"),
        PathArgument("--input", "pass files", several=True),
        PathArgument("--tokenizer", "pass byte", not_paths=frozenset({"byte"})),
        PathArgument("--hf", "pass an HF dir", contains="config.json"),
    ]
    assert missing_path(["to-hf", "--load", str(present)], arguments) is None
    assert (
        missing_path(["to-hf", f"--load={tmp_path / 'gone'}"], arguments)
        == f"--load {tmp_path / 'gone'} does not exist; pass X"
    )
    assert missing_path(["from-hf", "--load", "/gone"], arguments) is None  # another subcommand's --load
    assert "/gone2" in missing_path(["--input", str(present), "/gone2", "--tokenizer", "byte"], arguments)
    assert missing_path(["--tokenizer", "byte"], arguments) is None
    assert missing_path(["--hf", str(present)], arguments) == f"--hf {present} has no config.json; pass an HF dir"
    assert missing_path(["--load", "/gone", "--help"], [PathArgument("--load", "x")]) is None
    assert (
        missing_path(["--flag", "/gone"], [PathArgument("", "pass a path")]) == "path /gone does not exist; pass a path"
    )


IMPORTS_TORCH = (
    "import runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as stop:\n"
    "    print('exit', stop.code, 'torch', 'torch' in sys.modules)\n"
)


@pytest.mark.parametrize(
    "tool, args, named",
    [
        ("verify_checkpoint.py", ["{gone}"], "path {gone}"),
        ("score.py", ["--load", "{gone}", "--tokens-file", "t.json", "--out", "o.json"], "--load {gone}"),
        ("convert_checkpoint.py", ["to-hf", "--load", "{gone}", "--out", "{tmp}/hf"], "--load {gone}"),
        (
            "convert_checkpoint.py",
            ["from-hf", "--load", "{tmp}", "--out", "{tmp}/run"],
            "--load {tmp} has no config.json",
        ),
        ("preprocess_data.py", ["--input", "{gone}", "--output-prefix", "{tmp}/data"], "--input {gone}"),
    ],
)
def test_a_wrong_path_is_one_line_before_torch_loads(tmp_path, tool, args, named):
    fill = {"gone": str(tmp_path / "gone"), "tmp": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_TORCH, str(CHECKOUT / "tools" / tool), *[arg.format(**fill) for arg in args]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and named.format(**fill) in lines[0] and "; pass " in lines[0], result.stderr
    assert result.stdout.strip() == "exit 2 torch False", result.stdout + result.stderr
