"""`tools/plan.py --validate`'s launcher on 2 gloo ranks (one torchrun launch of the DP2 layout):
the bytes and messages comm.py counts are the planner's terms, every rank reports, and the memory
rows are there. No time is asserted: the exposed seconds are the tool's output, not a test's."""

from __future__ import annotations

import pytest

from k3train.planning.validate import VALIDATION_LAYOUTS, ValidationSettings, compare, launch


@pytest.mark.timeout(300)
def test_a_real_launch_counts_the_bytes_the_terms_predict():
    settings = ValidationSettings(steps=1, max_ranks=2, timeout_s=240)
    layout = next(layout for layout in VALIDATION_LAYOUTS if layout["name"] == "DP2")
    results = launch(settings, [layout])
    assert [spec["name"] for spec, _ in results] == ["DP2"]
    rows = compare(results, settings)
    counts = [row for row in rows if row.what in ("bytes", "messages")]
    assert counts and all(row.predicted == row.measured for row in counts)
    assert {row.term for row in rows if row.what == "exposed s"} >= {"dp"}
    memory = {row.term: row for row in rows if row.what == "memory B"}
    assert memory["weights"].ratio == pytest.approx(1.0, rel=0.01)  # buffers beside the parameters
