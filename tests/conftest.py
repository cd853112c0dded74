"""Make the checkout importable (k3train runs from a checkout, as Megatron-LM does) and keep
every test on one intra-op thread unless it asks otherwise: CI has two cores."""

import os
import pathlib
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
CHECKOUT = pathlib.Path(__file__).resolve().parents[1]
if str(CHECKOUT) not in sys.path:
    sys.path.insert(0, str(CHECKOUT))

import torch  # noqa: E402

torch.set_num_threads(1)
