"""The averaging protocol against a NumPy reference, on an in-process cluster.

Gradients are pushed by hand (for any worker index) so every check is
exact: the update must be the example-weighted mean of exactly the admitted
workers' rows, nothing else.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from trainer import sync

SHARDS = [5, 3]
LEARNING_RATE = 0.5


@pytest.fixture
def cluster():
    """A fresh in-process cluster: queues on a ps outlive a session."""
    ports = helpers.free_ports(3)
    spec = tf.train.ClusterSpec({
        "worker": [f"localhost:{ports[0]}"],
        "ps": [f"localhost:{p}" for p in ports[1:]]})
    servers = [tf.distribute.Server(spec, "worker", 0)] + [
        tf.distribute.Server(spec, "ps", i) for i in range(2)]
    return servers[0].target


class Protocol:
    """SyncState plus feedable pushes, one update, and probes."""

    def __init__(self, target, num_workers, replicas):
        self.graph = tf.Graph()
        devices = ["/job:ps/task:0", "/job:ps/task:1"]
        with self.graph.as_default():
            self.state = sync.SyncState(num_workers, replicas, SHARDS,
                                        devices, "test")
            with tf.device(devices[0]):
                self.params = [tf.compat.v1.get_variable(
                    f"params_{i}", [n], initializer=tf.zeros_initializer(),
                    use_resource=True) for i, n in enumerate(SHARDS)]
            with tf.device("/job:worker/task:0"):
                self.step_in = tf.compat.v1.placeholder(tf.int64, [])
                self.grads_in = [tf.compat.v1.placeholder(tf.float32, [n])
                                 for n in SHARDS]
                self.stats_in = tf.compat.v1.placeholder(tf.float32, [3])
            self.pushes = [self.state.push(k, self.step_in, self.grads_in,
                                           self.stats_in)
                           for k in range(num_workers)]
            with tf.device(devices[0]):
                step = self.state.global_step.read_value()
                mean, self.step_stats = self.state.aggregate(step)
                optimizer = tf.compat.v1.train.GradientDescentOptimizer(
                    LEARNING_RATE)
                update = optimizer.apply_gradients(zip(mean, self.params))
                self.next_step = self.state.finish_step(step, [update])
                self.token_counts = [q.size() for q in self.state.tokens]
                self.tokens = [self.state.next_token(k)
                               for k in range(num_workers)]
            init = tf.compat.v1.global_variables_initializer()
            start = self.state.start_op()
        self.session = tf.compat.v1.Session(target, graph=self.graph)
        self.session.run(init)
        self.session.run(start)

    def push(self, worker, step, grads, stats):
        feed = {self.step_in: step, self.stats_in: stats}
        feed.update(dict(zip(self.grads_in, grads)))
        self.session.run(self.pushes[worker], feed)

    def update(self, timeout_secs=20):
        options = tf.compat.v1.RunOptions(
            timeout_in_ms=int(timeout_secs * 1000))
        return self.session.run([self.next_step, self.step_stats],
                                options=options)

    def values(self):
        return self.session.run(self.params)

    def read(self, tensor):
        return self.session.run(tensor)


def random_push(rng, examples):
    grads = [rng.normal(size=n).astype(np.float32) for n in SHARDS]
    stats = np.array([examples, rng.random() * examples, examples // 2],
                     np.float32)
    return grads, stats


def test_update_is_the_example_weighted_mean_of_every_worker(cluster):
    rng = np.random.default_rng(0)
    protocol = Protocol(cluster, num_workers=3, replicas=3)
    protocol.read(protocol.tokens[1:])  # the start tokens (step 0)
    pushes = [random_push(rng, n) for n in (22, 21, 21)]
    for k, (grads, stats) in enumerate(pushes):
        protocol.push(k, 0, grads, stats)
    next_step, stats = protocol.update()
    assert next_step == 1
    np.testing.assert_allclose(stats, sum(p[1] for p in pushes), rtol=1e-6)
    for shard, value in enumerate(protocol.values()):
        expected = -LEARNING_RATE * sum(p[0][shard] for p in pushes) / 64
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7)
    # Every other worker got exactly one token, for step 1.
    assert protocol.read(protocol.token_counts[1:]) == [1, 1]
    assert protocol.read(protocol.tokens[1:]) == [1, 1]
    assert protocol.read(protocol.state.dropped) == 0


def test_no_update_until_every_replica_has_arrived(cluster):
    rng = np.random.default_rng(1)
    protocol = Protocol(cluster, num_workers=2, replicas=2)
    protocol.push(0, 0, *random_push(rng, 32))
    with pytest.raises(tf.errors.DeadlineExceededError):
        protocol.update(timeout_secs=1.0)
    np.testing.assert_array_equal(protocol.values()[0], np.zeros(5))
    # The admission survived the cancelled attempt: worker 1 completes it.
    grads, stats = random_push(rng, 32)
    protocol.push(1, 0, grads, stats)
    assert protocol.update()[0] == 1


def test_a_worker_is_admitted_once_per_step(cluster):
    rng = np.random.default_rng(2)
    protocol = Protocol(cluster, num_workers=2, replicas=2)
    first, second, chief = (random_push(rng, 32), random_push(rng, 32),
                            random_push(rng, 32))
    protocol.push(1, 0, *first)
    protocol.push(1, 0, *second)  # a restarted worker 1 redoes step 0
    protocol.push(0, 0, *chief)
    next_step, stats = protocol.update()
    assert next_step == 1
    assert stats[0] == 64  # two workers' examples, not three
    expected = -LEARNING_RATE * (second[0][0] + chief[0][0]) / 64
    np.testing.assert_allclose(protocol.values()[0], expected, rtol=1e-5,
                               atol=1e-7)
    assert protocol.read(protocol.state.dropped) == 0


def test_backup_workers_first_replicas_win_and_late_ones_are_dropped(
        cluster):
    rng = np.random.default_rng(3)
    protocol = Protocol(cluster, num_workers=3, replicas=2)
    w2, w0, late = (random_push(rng, 21), random_push(rng, 22),
                    random_push(rng, 21))
    protocol.push(2, 0, *w2)
    protocol.push(0, 0, *w0)
    next_step, stats = protocol.update()
    assert next_step == 1 and stats[0] == 43
    after_step0 = protocol.values()
    np.testing.assert_allclose(
        after_step0[1], -LEARNING_RATE * (w2[0][1] + w0[0][1]) / 43,
        rtol=1e-5, atol=1e-7)
    protocol.push(1, 0, *late)  # worker 1's gradient for step 0, too late
    a, b = random_push(rng, 22), random_push(rng, 21)
    protocol.push(0, 1, *a)
    protocol.push(1, 1, *b)
    assert protocol.update()[0] == 2
    assert protocol.read(protocol.state.dropped) == 1
    np.testing.assert_allclose(
        protocol.values()[0],
        after_step0[0] - LEARNING_RATE * (a[0][0] + b[0][0]) / 43,
        rtol=1e-5, atol=1e-6)


def test_a_worker_that_fell_behind_skips_to_the_newest_token(cluster):
    protocol = Protocol(cluster, num_workers=2, replicas=1)
    rng = np.random.default_rng(4)
    # Worker 0 alone advances three steps; worker 1 never pushes.
    for step in range(3):
        protocol.push(0, step, *random_push(rng, 32))
        protocol.update()
    assert protocol.read(protocol.token_counts[1]) == 4  # start + 3 steps
    assert protocol.read(protocol.tokens[1]) == 3
    assert protocol.read(protocol.token_counts[1]) == 0
