"""The job's choice of intra-op threads per rank (k3train/training/threads.py)."""

import pytest

from k3train.training.threads import available_cores, choose_num_threads


def test_configured_count_wins_over_everything():
    threads, line = choose_num_threads(3, {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "8"}, 16)
    assert threads == 3 and "train.num_threads" in line


def test_omp_num_threads_is_respected_when_nothing_is_configured():
    for configured in (None, 0):
        threads, line = choose_num_threads(configured, {"OMP_NUM_THREADS": "2", "LOCAL_WORLD_SIZE": "4"}, 16)
        assert threads == 2 and "OMP_NUM_THREADS" in line


@pytest.mark.parametrize("environ,cores,expected", [
    ({}, 2, 2),                                   # one process: every core it may use
    ({"LOCAL_WORLD_SIZE": "4"}, 16, 4),           # torchrun: the cores shared among local ranks
    ({"LOCAL_WORLD_SIZE": "4"}, 6, 1),            # rounded down
    ({"LOCAL_WORLD_SIZE": "8"}, 2, 1),            # never below one
    ({"LOCAL_WORLD_SIZE": "x", "OMP_NUM_THREADS": ""}, 3, 3),  # unreadable values are ignored
    ({"OMP_NUM_THREADS": "0"}, 4, 4),
])
def test_cores_divided_among_local_ranks(environ, cores, expected):
    threads, line = choose_num_threads(None, environ, cores)
    assert threads == expected
    assert line.startswith(f"threads: {expected} per rank (")
    assert "OMP_NUM_THREADS or train.num_threads" in line and "\n" not in line


def test_available_cores_is_positive():
    assert available_cores() >= 1
