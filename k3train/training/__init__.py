"""The training step loop, NaN/Inf guards, metrics and their sinks."""
