"""Planning a run without hardware: what the job would build and send, computed from its config."""
