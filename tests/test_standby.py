"""The graphs a task may switch to with --ps_mirrors, built and warmed
beforehand (trainer/roles/standby.py)."""

import socket
import threading
import types

from tests import helpers
from trainer.cluster.spec import make_cluster, make_task
from trainer.common.config import TrainConfig
from trainer.roles import standby
from trainer.roles import timing


def test_graphs_without_a_ps_are_built_beforehand_once_and_kept(
        monkeypatch):
    """standby.Graphs: prebuild builds each graph the task may switch to,
    once, on a thread, and warms those without a ps; a switch takes a
    graph with its warmed session and keeps the one it leaves; a connect
    closes the sessions warmed before it."""
    task = make_task(make_cluster(("ps0:1", "ps1:1", "ps2:1"), ("w0:1",),
                                  "test"), "worker", 0, "test")
    built, closed = [], []

    def build(ps_down):
        built.append(ps_down)
        return types.SimpleNamespace(ps_down=ps_down)

    def warm(graph, ps_down):
        session = types.SimpleNamespace(
            close=lambda: closed.append(ps_down))
        return types.SimpleNamespace(session=session, ps_down=ps_down)

    monkeypatch.setattr(timing, "BUILD_AHEAD_AFTER_SECS", 0.0)
    config = TrainConfig(logdir="unused", ps_mirrors=True)
    graphs = standby.Graphs(task, config, build, warm, ahead=True)
    full = types.SimpleNamespace(ps_down=None)
    graphs.prebuild(full).result()   # the one thread built both
    without_2, warmed = graphs.switch(full, 2)
    assert (without_2.ps_down, warmed.ps_down) == (2, 2)
    assert sorted(built) == [1, 2]
    graphs.connected()
    assert closed == [1]   # warmed before this connect
    graphs.prebuild(without_2).result()   # nothing to build or warm
    assert graphs.switch(without_2, None) == (full, None)
    assert graphs.switch(full, 2) == (without_2, None)
    assert sorted(built) == [1, 2] and closed == [1]
    plain = standby.Graphs(task, TrainConfig(logdir="unused"), build)
    assert plain.prebuild(full) is None   # without mirrors: nothing


def test_a_session_warmed_across_a_connect_is_closed(monkeypatch):
    """A connect while a graph is being warmed: its session may use a ps
    started again since, so it is closed, not kept for a switch."""
    task = make_task(make_cluster(("ps0:1", "ps1:1"), ("w0:1",), "test"),
                     "worker", 0, "test")
    warming, go_on, closed = threading.Event(), threading.Event(), []

    def warm(graph, ps_down):
        warming.set()
        assert go_on.wait(30)
        return types.SimpleNamespace(session=types.SimpleNamespace(
            close=lambda: closed.append(ps_down)))

    monkeypatch.setattr(timing, "BUILD_AHEAD_AFTER_SECS", 0.0)
    graphs = standby.Graphs(
        task, TrainConfig(logdir="unused", ps_mirrors=True),
        lambda ps_down: types.SimpleNamespace(ps_down=ps_down), warm,
        ahead=True)
    thread = graphs.prebuild(types.SimpleNamespace(ps_down=None))
    assert warming.wait(30)
    graphs.connected()
    go_on.set()
    thread.result()
    assert closed == [1]
    assert graphs.switch(types.SimpleNamespace(ps_down=None), 1)[1] is None


class _Reader:
    """A ps 0 reader whose run is held, and whose chief chooses to do
    without ps 1 at the third look."""

    def __init__(self):
        self.looks = 0

    def holds_run(self) -> bool:
        return True

    def ps_down(self):
        self.looks += 1
        return 1 if self.looks >= 3 else None


def test_a_worker_warms_the_graph_without_a_silent_ps_while_the_chief_chooses(
        monkeypatch):
    """A worker that finds ps 1 refusing while ps 0 holds a run warms its
    graph without ps 1 at once; the switch that follows the chief's choice
    takes that session, and a ps no one chose is not warmed."""
    ports = helpers.free_ports(2)
    listening = socket.socket()   # ps 0 answers, ps 1 refuses
    listening.bind(("localhost", ports[0]))
    listening.listen()
    task = make_task(make_cluster(
        (f"localhost:{ports[0]}", f"localhost:{ports[1]}"),
        ("localhost:1", "localhost:2"), "test"), "worker", 1, "test")
    warmed_for = []

    def warm(graph, ps_down):
        warmed_for.append(ps_down)
        return types.SimpleNamespace(ps_down=ps_down, session=None)

    graphs = standby.Graphs(
        task, TrainConfig(logdir="unused", ps_mirrors=True),
        lambda ps_down: types.SimpleNamespace(ps_down=ps_down), warm)
    graphs._reader = _Reader()
    try:
        assert graphs.choose("unused", as_chief=False) == (1, None)
    finally:
        listening.close()
    graph, warmed = graphs.switch(types.SimpleNamespace(ps_down=None), 1)
    assert (graph.ps_down, warmed.ps_down) == (1, 1)
    assert warmed_for == [1]


def test_a_warm_blocked_by_a_lost_ps_gives_up_and_closes_its_session(
        monkeypatch):
    """A session.run that needs a ps gone waits for it for ever (nemesis
    seed 981: a claim hung warming the chief's side). warm() waits at most
    --startup_timeout_secs, then closes the session, which ends the run."""
    import tensorflow as tf
    closed = threading.Event()
    monkeypatch.setattr(standby.sessions, "open_session", lambda *a, **k:
                        types.SimpleNamespace(close=closed.set))

    def blocking(session, fetches, feeds):
        def loop(*args):
            assert closed.wait(30), "never closed"
            raise tf.errors.CancelledError(None, None, "Session closed.")
        return loop
    monkeypatch.setattr(standby, "make_callable", blocking)
    graph = types.SimpleNamespace(graph=None, start_token=None,
                                  num_steps=None, chief=None, loop_outputs={})
    config = TrainConfig(logdir="unused", startup_timeout_secs=0.5)
    server = types.SimpleNamespace(target="")
    assert standby.warm(config, None, server, graph) is None
    assert closed.is_set()
