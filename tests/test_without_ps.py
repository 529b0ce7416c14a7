"""Doing without a ps (--ps_mirrors, trainer/roles/without_ps.py): the graph
that serves a ps's shards from their copies finds every variable the
run's graph holds, a push from a graph built otherwise than the chief's
is refused, and the chief's watch on the ps ports."""

import socket

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests.sync_protocol import SHARDS, Protocol, cluster  # noqa: F401
from trainer.cluster.spec import make_cluster, make_task
from trainer.common.config import TrainConfig
from trainer.roles import graph as graph_lib
from trainer.roles import without_ps
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
    assert without_ps.changed(refused.value)
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
        watch = without_ps.PsWatch(task, None, seen.append, lambda: None)
        assert watch.run_once() is True      # one look is not enough
        assert watch.run_once() is False and seen == [1]
        # Doing without ps 1: nothing until it answers.
        watch = without_ps.PsWatch(task, 1, None, lambda: seen.append("back"))
        assert watch.run_once() is True
        with socket.socket() as back:
            back.bind(("localhost", ports[1]))
            back.listen()
            assert watch.run_once() is False and seen[-1] == "back"
    finally:
        listening.close()
