"""Doing without a ps (--ps_mirrors, trainer/roles/serving.py): the graph
that serves a ps's shards from their copies finds every variable the
run's graph holds, a push from a graph built otherwise than the chief's
is refused, and the chief's watch on the ps ports."""

import socket
import time

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests.sync_protocol import SHARDS, Protocol, cluster  # noqa: F401
from trainer.cluster.spec import make_cluster, make_task
from trainer.common.config import TrainConfig
from trainer.roles import graph as graph_lib
from trainer.roles import serving
from trainer.sync import state


def _variables(num_ps: int, optimizer: str, ps_down):
    """{(name, device)} of the chief's global variables."""
    cluster_ = make_cluster(tuple(f"ps{i}:1" for i in range(num_ps)),
                            ("w0:1", "w1:1"), "test")
    config = TrainConfig(logdir="unused", ps_mirrors=True,
                         optimizer=optimizer)
    g = graph_lib.build_worker(config, make_task(cluster_, "worker", 0, "t"),
                               600, 100, 50, ps_down=ps_down)
    return {(v.op.name, v.device) for v in
            g.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)}


@pytest.mark.parametrize("num_ps,optimizer", [(2, "adam"), (3, "adam"),
                                              (2, "momentum")])
def test_without_a_ps_every_variable_but_gradient_rows_is_the_runs(
        num_ps, optimizer):
    """The graph without ps k reads the run's own variables on the other
    ps tasks (its shards' copies, their slots, Adam's step state); only
    the gradient rows of its shards are new, started afresh by the
    chief. Every shard of the run's graph is on its own ps."""
    full = _variables(num_ps, optimizer, None)
    for i in range(num_ps):
        assert (f"params/shard_{i}", f"/job:ps/task:{i}") in full
    for down in range(1, num_ps):
        served_by = (down + 1) % num_ps
        new = _variables(num_ps, optimizer, down) - full
        assert new == {(f"sync/grads_{down}", f"/job:ps/task:{served_by}")}


def test_a_push_from_a_graph_built_without_another_ps_is_refused(cluster):
    """The chief's graph does without ps 1 (sync/ps_down = 1): a push
    from a graph with every ps is refused, and the chief hears of none."""
    p = Protocol(cluster, 2)
    with p.graph.as_default():
        without_ps1 = p.shared.ps_down.assign(1)
        with_every_ps = p.shared.ps_down.assign(state.NO_PS_DOWN)
        queued = p.shared.events.size()
    p.run(without_ps1)
    token = np.array([0, 1, 0, 32], np.int64)
    grads = [np.ones(n, np.float32) for n in SHARDS]
    with pytest.raises(tf.errors.InvalidArgumentError) as refused:
        p.push(1, token, grads, np.ones(3, np.float32))
    assert serving.changed(refused.value)
    assert p.run(queued) == 0
    p.run(with_every_ps)
    p.push(1, token, grads, np.ones(3, np.float32))
    assert p.run(queued) == 1


def test_the_ps_watch_sees_a_ps_go_down_and_come_back():
    ports = helpers.free_ports(2)
    listening = socket.socket()
    listening.bind(("localhost", ports[0]))
    listening.listen()
    task = make_task(make_cluster(
        (f"localhost:{ports[0]}", f"localhost:{ports[1]}"),
        ("localhost:1",), "test"), "worker", 0, "test")
    seen = []
    try:
        # Every ps serving: ps 1 refuses (nothing listens on its port).
        watch = serving.PsWatch(task, None, seen.append, lambda: None)
        assert watch.run_once() is True      # one look is not enough
        assert watch.run_once() is False and seen == [1]
        # Doing without ps 1: nothing until it answers.
        watch = serving.PsWatch(task, 1, None, lambda: seen.append("back"))
        assert watch.run_once() is True
        with socket.socket() as back:
            back.bind(("localhost", ports[1]))
            back.listen()
            assert watch.run_once() is False and seen[-1] == "back"
    finally:
        listening.close()


def test_graphs_without_a_ps_are_built_beforehand_once_and_kept(
        monkeypatch):
    """serving.Graphs: prebuild builds each graph the task may switch to,
    once, on a thread, and warms those without a ps; a switch takes a
    graph with its warmed session and keeps the one it leaves; a connect
    closes the sessions warmed before it."""
    import types
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

    monkeypatch.setattr(serving, "PREBUILD_AFTER_SECS", 0.0)
    config = TrainConfig(logdir="unused", ps_mirrors=True)
    graphs = serving.Graphs(task, config, build, warm)
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
    plain = serving.Graphs(task, TrainConfig(logdir="unused"), build)
    assert plain.prebuild(full) is None   # without mirrors: nothing


def test_a_session_warmed_across_a_connect_is_closed(monkeypatch):
    """A connect while a graph is being warmed: its session may use a ps
    started again since, so it is closed, not kept for a switch."""
    import threading
    import types
    task = make_task(make_cluster(("ps0:1", "ps1:1"), ("w0:1",), "test"),
                     "worker", 0, "test")
    warming, go_on, closed = threading.Event(), threading.Event(), []

    def warm(graph, ps_down):
        warming.set()
        assert go_on.wait(30)
        return types.SimpleNamespace(session=types.SimpleNamespace(
            close=lambda: closed.append(ps_down)))

    monkeypatch.setattr(serving, "PREBUILD_AFTER_SECS", 0.0)
    graphs = serving.Graphs(
        task, TrainConfig(logdir="unused", ps_mirrors=True),
        lambda ps_down: types.SimpleNamespace(ps_down=ps_down), warm)
    thread = graphs.prebuild(types.SimpleNamespace(ps_down=None))
    assert warming.wait(30)
    graphs.connected()
    go_on.set()
    thread.result()
    assert closed == [1]
    assert graphs.switch(types.SimpleNamespace(ps_down=None), 1)[1] is None
