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


@pytest.mark.parametrize(
    "environ,cores,expected",
    [
        ({}, 2, 2),  # one process: every core it may use
        ({"LOCAL_WORLD_SIZE": "4"}, 16, 4),  # torchrun: the cores shared among local ranks
        ({"LOCAL_WORLD_SIZE": "4"}, 6, 1),  # rounded down
        ({"LOCAL_WORLD_SIZE": "8"}, 2, 1),  # never below one
        ({"LOCAL_WORLD_SIZE": "x", "OMP_NUM_THREADS": ""}, 3, 3),  # unreadable values are ignored
        ({"OMP_NUM_THREADS": "0"}, 4, 4),
    ],
)
def test_cores_divided_among_local_ranks(environ, cores, expected):
    threads, line = choose_num_threads(None, environ, cores)
    assert threads == expected
    assert line.startswith(f"threads: {expected} per rank (")
    assert "OMP_NUM_THREADS or train.num_threads" in line and "\n" not in line


def test_available_cores_is_positive():
    assert available_cores() >= 1


@pytest.mark.parametrize(
    "busy, local_ranks, expected", [(0.0, 1, 8), (0.5, 1, 4), (0.5, 2, 2), (0.99, 1, 1), (1.0, 4, 1)]
)
def test_busy_machine_counts_only_free_cores(busy, local_ranks, expected):
    threads, line = choose_num_threads(None, {"LOCAL_WORLD_SIZE": str(local_ranks)}, 8, busy)
    assert threads == expected
    assert "busy" in line if busy else "busy" not in line


def test_machine_busy_fraction_is_a_fraction():
    from k3train.training.threads import machine_busy_fraction

    assert 0.0 <= machine_busy_fraction() <= 1.0


# torchrun puts OMP_NUM_THREADS=1 in its ranks' environment when the user left it unset (and
# nproc_per_node > 1): the agent's own start-up environment tells the two apart.
TORCHRUN_RANK = {"TORCHELASTIC_RUN_ID": "run", "LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}


def test_torchrun_default_omp_is_not_taken_for_the_users_choice():
    threads, line = choose_num_threads(None, TORCHRUN_RANK, 16, launcher_variables={"PATH", "HOME"})
    assert threads == 4
    assert "16 cores / 4 local ranks" in line and "torchrun's default OMP_NUM_THREADS=1 not used" in line


def test_omp_the_user_gave_torchrun_is_respected():
    threads, line = choose_num_threads(None, TORCHRUN_RANK, 16, launcher_variables={"PATH", "OMP_NUM_THREADS"})
    assert threads == 1 and line == "threads: 1 per rank (OMP_NUM_THREADS=1)"


def test_unknown_origin_under_torchrun_keeps_one_and_says_why():
    threads, line = choose_num_threads(None, TORCHRUN_RANK, 16, launcher_variables=None)
    assert threads == 1 and "torchrun also sets" in line and "train.num_threads" in line


def test_omp_other_than_torchruns_default_is_always_the_users():
    environ = dict(TORCHRUN_RANK, OMP_NUM_THREADS="3")
    assert choose_num_threads(None, environ, 16, launcher_variables=set())[0] == 3


def test_launcher_environment_reads_the_start_up_environment_of_the_parent():
    import os
    import subprocess
    import sys

    from k3train.training.threads import launcher_environment

    assert launcher_environment({}) is None  # not a torchrun rank
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, time; os.environ['OMP_NUM_THREADS'] = '1'; print(flush=True); time.sleep(30)",
        ],
        env=env,
        stdout=subprocess.PIPE,
    ) as agent:
        try:
            agent.stdout.readline()  # the variable is set in its os.environ by now, as torchrun does
            names = launcher_environment({"TORCHELASTIC_RUN_ID": "x"}, parent_pid=agent.pid)
        finally:
            agent.kill()
    if names is None:
        pytest.skip("no /proc/<pid>/environ on this platform")
    assert "PATH" in names and "OMP_NUM_THREADS" not in names


@pytest.mark.timeout(180)
@pytest.mark.parametrize("user_omp", [None, "1"])
def test_under_torchrun_ranks_tell_its_default_from_the_users(tmp_path, user_omp):
    """Two ranks under the real torchrun: unset, the cores are divided (the ranks only print
    their choice, so OMP_NUM_THREADS may stay unset here); set to 1 by the user, it is kept."""
    import os
    import subprocess
    import sys

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys\n"
        "from k3train.training.threads import choose_num_threads, launcher_environment\n"
        "line = choose_num_threads(None, os.environ, 8, 0.0, launcher_environment(os.environ))[1]\n"
        # Each rank writes its own file: two ranks printing to one pipe can interleave mid-line.
        f"open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w').write(line)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if user_omp:
        env["OMP_NUM_THREADS"] = user_omp
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(probe)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = [(tmp_path / f"rank{rank}").read_text() for rank in range(2)]
    if user_omp:
        assert all(line == "threads: 1 per rank (OMP_NUM_THREADS=1)" for line in lines), lines
    else:
        assert all(
            line.startswith("threads: 4 per rank (8 cores / 2 local ranks; torchrun's default") for line in lines
        ), lines
