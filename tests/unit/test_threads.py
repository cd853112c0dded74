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


@pytest.mark.parametrize("busy, local_ranks, expected", [(0.0, 1, 8), (0.5, 1, 4), (0.5, 2, 2), (0.99, 1, 1), (1.0, 4, 1)])
def test_busy_machine_counts_only_free_cores(busy, local_ranks, expected):
    threads, line = choose_num_threads(None, {"LOCAL_WORLD_SIZE": str(local_ranks)}, 8, busy)
    assert threads == expected
    assert "busy" in line if busy else "busy" not in line


def test_machine_busy_fraction_is_a_fraction():
    from k3train.training.threads import machine_busy_fraction

    assert 0.0 <= machine_busy_fraction() <= 1.0
