"""tools/ablate.py: variant parsing and the comparison table from each run's metrics.jsonl."""

import importlib.util
import json
import math
import pathlib

import pytest

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ablate", CHECKOUT / "tools" / "ablate.py")
ablate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablate)


def write_run(run_dir: pathlib.Path, losses: list[float], validation: float) -> None:
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "loss": loss, "tokens_per_s": 1000.0 + i}) for i, loss in enumerate(losses)]
    lines.append(json.dumps({"step": len(losses), "validation_loss": validation}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_summary_and_table(tmp_path):
    write_run(tmp_path / "block", [6.0, 5.0, 4.0, 3.0], 3.5)
    row = ablate.summarize("block", tmp_path / "block", window=2)
    assert row["steps"] == 4 and row["first loss"] == 6.0 and row["final loss"] == 3.0
    assert math.isclose(row["mean last 2"], 3.5) and row["validation"] == 3.5
    table = ablate.format_table([row, ablate.summarize("missing", tmp_path / "missing", 2)])
    assert "| block | 4 | 6.0000 | 3.0000 |" in table and "| missing | 0 |" in table


def test_variants_and_shared_overrides_are_parsed():
    args, shared = ablate.parse_args(["--recipe", "r.yaml", "--out", "o", "--variant", "a", "model.attn_res=none",
                                      "--variant", "b", "--", "train.steps=5"])
    assert args.variant == [["a", "model.attn_res=none"], ["b"]] and shared == ["train.steps=5"]
    with pytest.raises(SystemExit):
        ablate.parse_args(["--recipe", "r", "--out", "o", "--variant", "a", "--variant", "a"])
