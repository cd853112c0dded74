"""The README's shell blocks, run in the order a newcomer reads them, at debug sizes.

Every command of every ```bash block runs in one scratch directory that links the checkout's
files (so `runs/`, `hf/` and `data/` land there, and a later command finds what an earlier one
wrote, as it would for the reader). Debug sizes: each training run takes `train.steps=2`
(replacing the block's own count), a sweep `--seeds 1`. The refused world size of the planner section must exit 2. Two commands are not run: the test
command (it is what runs this test) and the multi-node launch (it needs several machines).
`corpus.jsonl`, the reader's own data in the README, is a small file written here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
NOT_RUN = {
    "bash tools/setup_and_test.sh": "the test command itself",
    "--nnodes=N": "a multi-node launch",
}
# The README shows this one being refused (a world size no fitting layout divides; status 2).
REFUSED = {"--world-size 1000": 2}
DEBUG_STEPS = "train.steps=2"
COMMAND_TIMEOUT_S = 600


def readme_commands(text: str) -> list[str]:
    """The commands of the README's ```bash blocks, in order: comments dropped, `\\` continuations
    joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [command for command in map(_without_comment, joined.splitlines()) if command]
    return commands


def _without_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (outside quotes, after a blank)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


def at_debug_size(command: str) -> str:
    """The command with the training runs cut to a couple of steps."""
    if "pretrain_k3.py" in command and "--help" not in command:
        if "train.steps=" in command:
            return re.sub(r"train\.steps=\d+", DEBUG_STEPS, command)
        return f"{command} {DEBUG_STEPS}"
    if "tools/ablate.py" in command:
        command = re.sub(r"--seeds \d+", "--seeds 1", command)
        if "--seeds" not in command:
            command = command.replace("tools/ablate.py", "tools/ablate.py --seeds 1", 1)
        if "train.steps=" in command:
            return re.sub(r"train\.steps=\d+", DEBUG_STEPS, command)
        return f"{command} {DEBUG_STEPS}" if " -- " in command else f"{command} -- {DEBUG_STEPS}"
    return command


def _scratch(tmp_path: Path) -> Path:
    for entry in CHECKOUT.iterdir():
        if entry.name not in {".git", "runs", ".venv", ".cache"}:
            (tmp_path / entry.name).symlink_to(entry)
    with open(tmp_path / "corpus.jsonl", "w") as corpus:
        for path in sorted((CHECKOUT / "k3train" / "model").glob("*.py")):
            corpus.write(json.dumps({"text": path.read_text()}) + "\n")
    return tmp_path


def test_readme_commands_parse_into_the_expected_order():
    commands = readme_commands((CHECKOUT / "README.md").read_text())
    first_train = next(i for i, c in enumerate(commands) if "pretrain_k3.py" in c)
    first_export = next(i for i, c in enumerate(commands) if "to-hf" in c)
    # the export reads the debug run's checkpoints, which the first command writes
    assert "--run-dir runs/debug" in commands[first_train] and "runs/debug/checkpoints" in commands[first_export]
    assert (
        at_debug_size("python pretrain_k3.py --recipe r.yaml train.steps=30")
        == "python pretrain_k3.py --recipe r.yaml train.steps=2"
    )
    assert (
        at_debug_size("python tools/ablate.py --sweep s.yaml --seeds 3 --out o")
        == "python tools/ablate.py --sweep s.yaml --seeds 1 --out o -- train.steps=2"
    )


@pytest.mark.timeout(3000)
def test_readme_shell_blocks_run_in_order(tmp_path):
    scratch = _scratch(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    ran = []
    for command in readme_commands((CHECKOUT / "README.md").read_text()):
        if any(marker in command for marker in NOT_RUN):
            continue
        command = at_debug_size(command)
        result = subprocess.run(
            ["bash", "-c", command],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        expected = next((status for marker, status in REFUSED.items() if marker in command), 0)
        assert result.returncode == expected, (
            f"README command: status {result.returncode}, expected {expected} : {command}\n"
            f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        )
        ran.append(command)
    assert any("to-hf" in c for c in ran) and any("torchrun" in c for c in ran), ran
