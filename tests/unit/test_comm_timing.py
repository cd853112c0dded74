"""The exposed-communication clock of `parallel/comm.py` and its emulated links, without
processes: a stand-in work object and a recorded sleep instead of a network."""

import pytest

from k3train.parallel import comm
from k3train.parallel.comm import EmulatedLink, TimedWork, TrafficCounter
from k3train.parallel.config import check_emulated_network
from k3train.parallel.state import emulated_links
from k3train.training.loop import exposed_communication


class DoneWork:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Clock:
    """A fake `time.perf_counter` that `time.sleep` advances (so no test waits)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(comm.time, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(comm.time, "sleep", fake.sleep)
    return fake


def test_an_early_wait_is_held_to_the_link_and_counted(clock):
    link = EmulatedLink(bandwidth_bytes_per_s=1e9, latency_s=1e-3)
    counter = TrafficCounter()
    work = TimedWork(DoneWork(), "ep", counter, link, nbytes=4_000_000)  # 1 ms + 4 ms on the wire
    clock.now += 2e-3  # 2 ms of compute before the wait
    work.wait()
    assert clock.sleeps == [pytest.approx(3e-3)]
    assert counter.wait_seconds["ep"] == pytest.approx(3e-3)


def test_a_wait_after_enough_compute_is_hidden(clock):
    counter = TrafficCounter()
    work = TimedWork(DoneWork(), "ep", counter, EmulatedLink(1e9, 1e-3), nbytes=4_000_000)
    clock.now += 6e-3  # more compute than the 5 ms the link takes
    work.wait()
    assert clock.sleeps == [] and counter.wait_seconds["ep"] == 0.0


def test_transfers_queue_on_the_link(clock):
    """Two 2-ms pieces launched together: the second arrives 2 ms after the first (the wire is
    shared), so 2 ms of compute after the first wait hides the second entirely."""
    counter = TrafficCounter()
    link = EmulatedLink(1e9, 0.0)
    first = TimedWork(DoneWork(), "tp", counter, link, nbytes=2_000_000)
    second = TimedWork(DoneWork(), "tp", counter, link, nbytes=2_000_000)
    first.wait()
    assert clock.sleeps == [pytest.approx(2e-3)]
    clock.now += 2e-3  # the GEMMs of the first piece
    second.wait()
    assert clock.sleeps == [pytest.approx(2e-3)] and counter.wait_seconds["tp"] == pytest.approx(2e-3)


def test_without_a_link_nothing_is_delayed(clock):
    counter = TrafficCounter()
    TimedWork(DoneWork(), "dp", counter, None, nbytes=10**9).wait()
    assert clock.sleeps == [] and counter.wait_seconds["dp"] == 0.0
    counter.reset()
    assert not counter.wait_seconds


def test_links_from_the_config_and_refusals():
    links = emulated_links({"ep": [25.0, 10.0]})
    assert links["ep"].seconds(25_000) == pytest.approx(10e-6 + 1e-6)
    check_emulated_network({"tp": [200.0, 0.0]})
    with pytest.raises(Exception, match="unknown group 'pp_grad'"):
        check_emulated_network({"pp_grad": [1.0, 1.0]})
    with pytest.raises(Exception, match=r"parallel.emulate_network.ep must be \[bandwidth"):
        check_emulated_network({"ep": [1.0]})


def test_exposed_communication_is_the_step_s_difference():
    assert exposed_communication({"ep": 1.0}, {"ep": 1.5, "dp": 0.25, "tp": 0.0}) == {"dp": 0.25, "ep": 0.5}


def test_the_link_carries_transfers_in_launch_order_whatever_the_wait_order(clock):
    """A dispatch launched before a blocking collective is on the link first even though the
    blocking call returns (and books the link) before the dispatch is waited for: the blocking
    call waits for it, and the dispatch, waited for later, is then already there (the order
    `parallel.ep_overlap_halves` relies on: one half's dispatch under the other half's mixer)."""
    from k3train.parallel.comm import Group

    counter = TrafficCounter()
    link = EmulatedLink(1e9, 0.0)
    group = Group("ep", (0, 1), 0, None, counter, link)
    dispatch = TimedWork(DoneWork(), "ep", counter, link, nbytes=4_000_000)  # 4 ms on the wire
    clock.now += 1e-3  # 1 ms of the other half's mixer
    with group._blocking(None, "all_gather"):  # its loads all-gather: 0 bytes, behind the dispatch
        pass
    assert clock.sleeps == [pytest.approx(3e-3)]
    dispatch.wait()  # delivered while the loads waited
    assert clock.sleeps == [pytest.approx(3e-3)] and counter.wait_seconds["ep"] == pytest.approx(3e-3)
