"""The averaging protocol on an in-process cluster, shared by the protocol
and wire tests (tests/test_sync.py, tests/test_wire.py): a fresh cluster
per test, and `Protocol` (the rule, the transport and one update with
feedable pushes, events and reads) with helpers that push by hand."""

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from trainer.sync import averaging
from trainer.sync import pull_turns
from trainer.sync import state
from trainer.sync import transport as transport_lib

SHARDS = [5, 3]
SOME_STEP = 7   # a step number of no significance
# Probes come this long after a benched worker's last token: long enough
# that none falls due by itself in a test, which makes them due with
# set_issued_ago.
PROBE_SECS = 600.0
LEARNING_RATE = 0.5
RECORDED_STEPS = 8   # the per-step record's length (SharedState.by_step)


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
    """The rule, the transport and one update on an in-process cluster,
    with feedable pushes, events and reads.

    `plan(step)` starts a round (the chief's token back), `admit(step,
    round)` waits for it, `apply(step)` averages the admitted rows,
    applies them with plain SGD and advances the step.
    """

    def __init__(self, target, num_workers, backup_workers=0,
                 wire_dtype=tf.float32, batch=64, slices="equal"):
        self.graph = tf.Graph()
        devices = ["/job:ps/task:0", "/job:ps/task:1"]
        with self.graph.as_default():
            self.shared = state.SharedState(num_workers, SHARDS, devices,
                                            train_steps=RECORDED_STEPS)
            turns = pull_turns.PullTurns(num_workers, devices, False)
            self.rule = averaging.Averaging(self.shared, batch, backup_workers,
                                            slices, turns)
            self.rule.pace.probe_secs = PROBE_SECS
            transport = transport_lib.Transport(self.shared, wire_dtype)
            self.params = []
            for i, n in enumerate(SHARDS):
                with tf.device(devices[i]):
                    self.params.append(tf.compat.v1.get_variable(
                        f"params_{i}", [n], initializer=tf.zeros_initializer(),
                        use_resource=True))
            with tf.device(devices[0]):
                self.read_token_in = tf.compat.v1.placeholder(
                    tf.int64, [4], "read_token")
                self.step_in = tf.compat.v1.placeholder(tf.int64, [])
                self.round_in = tf.compat.v1.placeholder(tf.int64, [])
                self.kind_in = tf.compat.v1.placeholder(tf.int32, [])
                self.worker_in = tf.compat.v1.placeholder(tf.int32, [])
                read_token = tf.identity(self.read_token_in)
            with tf.device("/job:worker/task:0"):
                self.token_in = tf.compat.v1.placeholder(tf.int64, [4])
                self.grads_in = [tf.compat.v1.placeholder(tf.float32, [n])
                                 for n in SHARDS]
                self.stats_in = tf.compat.v1.placeholder(tf.float32, [3])
                self.read_params = transport.pull(
                    read_token, self.params, [read_token] * 2)
            self.pushes = [transport.push(k, self.token_in, self.grads_in,
                                          self.stats_in)
                           for k in range(num_workers)]
            self.params_in = [tf.compat.v1.placeholder(tf.float32, [n])
                              for n in SHARDS]
            self.set_params = [p.assign(v, read_value=False)
                               for p, v in zip(self.params, self.params_in)]
            self._chief_ops(devices[0], num_workers)
            init = tf.compat.v1.global_variables_initializer()
        self.session = tf.compat.v1.Session(target, graph=self.graph)
        self.session.run(init)

    def _chief_ops(self, device, num_workers):
        with tf.device(device):
            _, self.planned = self.rule.plan(self.step_in)
            self.verdict = self.rule.admit(self.step_in, self.round_in)
            rows = tf.where(self.shared.admitted.read_value())[:, 0]
            mean, self.step_stats = self.rule.average(rows)
            optimizer = tf.compat.v1.train.GradientDescentOptimizer(
                LEARNING_RATE)
            update = optimizer.apply_gradients(zip(mean, self.params))
            self.next_step = self.rule.count_and_advance(self.step_in,
                                                         [update])
            self.event = self.shared.send_event(self.kind_in, self.worker_in)
            self.late = self.shared.send_event(state.LATE, 0, self.step_in,
                                               self.round_in)
            self.deadlines = self.shared.take_deadlines()
            self.deadline_count = self.shared.deadlines.size()
            self.absorb = self.rule.absorb_queued()
            self.token_counts = [q.size() for q in self.shared.tokens]
            self.tokens = [self.shared.next_token(k)
                           for k in range(num_workers)]
            self.records = self.shared.take_membership()
            self.secs_in = tf.compat.v1.placeholder(tf.float32,
                                                    [num_workers])
            # As after every worker answered a first slice (not timed),
            # its token issued now.
            answered = tf.maximum(self.shared.issued_round.read_value(), 1)
            self.set_secs = tf.group(
                self.shared.slice_secs.assign(self.secs_in),
                self.shared.issued_round.assign(answered),
                self.shared.answered.assign(answered),
                self.shared.issued_at.assign(
                    tf.fill([num_workers], tf.timestamp())))
            self.speed_in = tf.compat.v1.placeholder(tf.float32,
                                                     [num_workers])
            self.set_speed = self.shared.speed.assign(self.speed_in,
                                                      read_value=False)
            # Each worker's last token issued ago_in seconds ago.
            self.ago_in = tf.compat.v1.placeholder(tf.float64,
                                                   [num_workers])
            self.set_issued_ago = self.shared.issued_at.assign(
                tf.timestamp() - self.ago_in, read_value=False)

    def run(self, fetches, feed=None, timeout_secs=20.0):
        return self.session.run(fetches, feed, options=tf.compat.v1.RunOptions(
            timeout_in_ms=int(timeout_secs * 1000)))

    def send(self, kind, worker):
        self.run(self.event, {self.kind_in: kind, self.worker_in: worker})

    def join(self, *workers):
        for k in workers:
            self.send(state.JOINED, k)
        return self.run(self.absorb)

    def plan(self, step):
        return self.run(self.planned, {self.step_in: step})

    def admit(self, token, timeout_secs=20.0):
        """(complete, admitted rows) of the round of `token`."""
        complete, rows = self.run(
            [self.verdict.complete, self.verdict.rows],
            {self.step_in: token[0], self.round_in: token[1]}, timeout_secs)
        return bool(complete), sorted(rows.tolist())

    def apply(self, step):
        return self.run([self.next_step, self.step_stats],
                        {self.step_in: step})

    def push_feed(self, token, grads, stats):
        feed = {self.token_in: token, self.stats_in: stats}
        feed.update(dict(zip(self.grads_in, grads)))
        return feed

    def push(self, worker, token, grads, stats):
        self.run(self.pushes[worker], self.push_feed(token, grads, stats))

    def set_values(self, values):
        self.run(self.set_params, dict(zip(self.params_in, values)))

    def read_on_worker(self, token):
        """(token, shard values) as the pull gives them to the worker."""
        return self.run(self.read_params, {self.read_token_in: token})

    def values(self):
        return self.run(self.params)

    def read(self, tensor):
        return self.run(tensor)


def random_push(rng, examples):
    grads = [rng.normal(size=n).astype(np.float32) for n in SHARDS]
    stats = np.array([examples, rng.random() * examples, examples // 2],
                     np.float32)
    return grads, stats


def push_all(protocol, rng, tokens: dict) -> dict:
    """Worker k pushes a random gradient for tokens[k], with its slice's
    example count; returns {k: (grads, stats)}."""
    pushes = {}
    for k, token in tokens.items():
        pushes[k] = random_push(rng, int(token[3] - token[2]))
        protocol.push(k, token, *pushes[k])
    return pushes


def round_tokens(protocol, step, workers) -> dict:
    """Plans a round of `step` and returns every member's token."""
    tokens = {0: protocol.plan(step)}
    for k in workers:
        tokens[k] = protocol.read(protocol.tokens[k])
    return tokens


def assert_mean_applied(protocol, before, pushes, examples=64):
    for shard, value in enumerate(protocol.values()):
        expected = before[shard] - LEARNING_RATE * sum(
            p[0][shard] for p in pushes) / examples
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)
