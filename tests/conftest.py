"""Make the checkout under test the k3train every test process imports, keep every
test on one intra-op thread unless it asks otherwise (CI has two cores), and sort the tests into
tiers by folder.

Tiers (pytest markers): `unit` (tests/unit less its `slow` tests: the edit loop's quick tier),
`distributed` (gloo in several processes), `faults` (fault injection), `e2e` (the job and the
README as a user runs them) and `slow` (a unit test of more than about ten seconds on two cores).
`pytest -m unit` is the quick tier; plain `pytest` (CI) runs all of them. Every test has a
deadline through pytest-timeout (the `timeout` of pyproject.toml), so a hung collective fails;
without the plugin the suite refuses to start rather than run without deadlines.
"""

import os
import pathlib

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
CHECKOUT = pathlib.Path(__file__).resolve().parents[1]
# pytest puts the checkout first on this process's path (`pythonpath` in pyproject.toml); the
# processes the tests start (gloo workers, the job, the tools) find it through PYTHONPATH, ahead
# of whichever k3train is installed.
os.environ["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])])

import torch  # noqa: E402  (after the thread count is set)

torch.set_num_threads(1)

FOLDER_TIERS = {"unit": "unit", "distributed": "distributed", "faults": "faults", "e2e": "e2e"}


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError(
            "pytest-timeout is not installed, so no test would have a deadline: "
            "source tools/setup_env.sh (or pip install pytest-timeout)"
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = pathlib.Path(str(item.fspath)).relative_to(CHECKOUT / "tests").parts[0]
        tier = FOLDER_TIERS.get(folder)
        if tier == "unit" and item.get_closest_marker("slow"):
            continue  # slow unit tests stay out of the quick tier
        if tier:
            item.add_marker(tier)
