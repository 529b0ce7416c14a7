"""A link cut for long: the calls after its return go through at once
(trainer/cluster/devices.py, give_up_silent_connections).

Needs root and simulated hosts (trainer/bench/simhosts).
"""

import os
import re
import selectors
import subprocess
import sys
import time

import pytest

from tests import helpers
from trainer.bench.simhosts import hosts

CUT_SECS = 30          # long enough for TCP's backoff to pass 20 s
TIMEOUT_SECS = 3       # --worker_timeout_secs of both tasks
BACKOFF_SECS = 15      # a call after the cut waiting this long waited out
                       # TCP's backoff (its next try: up to 25 s later)


@pytest.fixture
def simulated():
    try:
        hosts.check_available()
    except Exception as e:  # noqa: BLE001 (its one line is the reason)
        pytest.skip(str(e))
    with hosts.SimulatedHosts() as made:
        yield made


def start(host, role: str, ps, worker, stdin=None) -> subprocess.Popen:
    return host.popen(
        [sys.executable, "-m", "tests.grpc_peer", role, f"{ps.address}:2222",
         f"{worker.address}:2222", str(TIMEOUT_SECS)],
        env=helpers.python_env(), stdin=stdin, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True)


@pytest.mark.hosts
def test_a_new_session_after_a_long_cut_works_at_once(simulated):
    """Without give_up_silent_connections, the connection that carried
    calls when the link went down waits out TCP's backoff after the
    link's return, and the new session's first call fails (at once, or
    when TCP tries again up to 25 s later: seen in every run here). With
    it, the push goes through at once, or after one reset."""
    ps, worker = simulated.add_host("ps"), simulated.add_host("worker")
    start(ps, "ps", ps, worker)
    pusher = start(worker, "worker", ps, worker, stdin=subprocess.PIPE)
    assert _line(pusher, 120) == "pushing"
    worker.link_down()
    try:
        time.sleep(CUT_SECS)
    finally:
        worker.link_up()
    pusher.stdin.write("new session\n")
    pusher.stdin.flush()
    # A connection closed by its far end during the cut (the ps's to the
    # worker, whose reply was in flight) may fail the first call at once
    # with a reset, and the trainer connects again; what must not happen
    # is a call that waits out TCP's backoff.
    line = _line(pusher, 120)
    said = re.fullmatch(r"new session: ok, ([01]) reset\(s\), (\S+) s", line)
    assert said, line
    assert float(said.group(2)) < BACKOFF_SECS


def _line(process: subprocess.Popen, timeout: float) -> str:
    """The process's next line of output, waiting at most `timeout` s."""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            pytest.fail(f"no output within {timeout:.0f} s")
    return process.stdout.readline().strip()


def test_the_users_grpc_options_win(monkeypatch):
    from trainer.cluster import devices
    from trainer.common.config import TrainConfig
    monkeypatch.setenv(devices.GRPC_OPTIONS_ENV,
                       "grpc.keepalive_timeout_ms=500,grpc.x=1")
    devices.give_up_silent_connections(
        TrainConfig(logdir="unused", worker_timeout_secs=7))
    assert os.environ[devices.GRPC_OPTIONS_ENV].split(",") == [
        "grpc.keepalive_timeout_ms=500", "grpc.x=1",
        f"grpc.keepalive_time_ms={devices.NO_PINGS_MS}"]
    monkeypatch.delenv(devices.GRPC_OPTIONS_ENV)
    devices.give_up_silent_connections(
        TrainConfig(logdir="unused", worker_timeout_secs=7))
    assert os.environ[devices.GRPC_OPTIONS_ENV].split(",") == [
        f"grpc.keepalive_time_ms={devices.NO_PINGS_MS}",
        "grpc.keepalive_timeout_ms=7000"]
