"""Recipe-driven ablations: sweeps of training runs, their statistics, plots and ladder fits (tools/ablate.py)."""
