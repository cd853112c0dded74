"""The run's `done:` line (k3train/training/summary.py): the run's first loss, not the resumed
process's, read back from metrics.jsonl."""

import json

from k3train.training.summary import done_line, first_logged_loss


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def steps(first, last, loss=lambda s: 6.0 - s / 10):
    return [{"step": s, "loss": loss(s)} for s in range(first, last + 1)]


def test_fresh_run_uses_its_own_history(tmp_path):
    assert done_line(steps(1, 3), 0, None) == "done: step 3, loss 5.9000 (step 1) → 5.7000 (step 3)"


def test_resume_reads_the_first_loss_back(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # A killed first process (steps 1-5, checkpoint at 4), a validation record, a cut line, the resume.
    write(metrics, steps(1, 5) + [{"step": 4, "validation_loss": 5.0}] + steps(5, 8))
    with open(metrics, "a") as stream:
        stream.write('[1, 2]\n{"step": 9, "lo')  # not a record; a line cut mid-write
    assert done_line(steps(5, 8), 4, metrics) == "done: step 8, loss 5.9000 (step 1) → 5.2000 (step 8)"


def test_a_fresh_start_in_the_same_directory_is_the_runs_start(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write(metrics, steps(1, 6, lambda s: 9.0) + steps(1, 3) + steps(4, 6))
    assert first_logged_loss(metrics, 4) == (1, 5.9)
    assert first_logged_loss(metrics, 0) is None


def test_log_interval_and_a_missing_record(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write(metrics, [r for r in steps(1, 20) if r["step"] % 5 == 0])  # train.log_interval=5
    assert first_logged_loss(metrics, 10) == (5, 5.5)
    assert (
        done_line(steps(11, 20), 10, tmp_path / "absent.jsonl")
        == "done: step 20, loss 4.9000 (step 11, since resume at step 10) → 4.0000 (step 20)"
    )
