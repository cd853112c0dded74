"""The job's lifecycle around the training loop: start-up checks (`preflight.py`), stop signals
turned into a saved, agreed stop (`signals.py`), and how a job ends on every rank (`ending.py`)."""
