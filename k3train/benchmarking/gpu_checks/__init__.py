"""The checks of tools/gpu_check.py, one module per subject; each `check_*` function takes the
run's `common.Context` and yields table rows (`common.Row`). tools/gpu_check.py registers them
in table order."""
