"""Per-Head Muon with AdamW grouping, learning-rate schedules and gradient clipping."""
