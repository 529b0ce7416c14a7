"""The averaging protocol against a NumPy reference, on an in-process cluster.

Gradients are pushed by hand (for any worker index) so every check is
exact: the update must be the example-weighted mean of exactly the admitted
workers' rows, nothing else. With a 16-bit wire dtype, the rows must be
the workers' gradients rounded to it, the step and statistics bit-exact,
and the bytes crossing between ps and worker those of the wire dtype.
"""

import re

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from trainer.common import config as config_lib
from trainer.common.errors import UserError
from trainer.sync import averaging
from trainer.sync import pace
from trainer.sync import pull_turns
from trainer.sync import state
from trainer.sync import transport as transport_lib

SHARDS = [5, 3]
PROBE_FREE_STEP = 7   # not a multiple of pace.PROBE_EVERY
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
            self.shared = state.SharedState(num_workers, SHARDS, devices)
            turns = pull_turns.PullTurns(num_workers, devices, False)
            self.rule = averaging.Averaging(self.shared, batch, backup_workers,
                                            slices, turns)
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
            self.planned = self.rule.plan(self.step_in)
            self.verdict = self.rule.admit(self.step_in, self.round_in)
            rows = tf.where(self.shared.admitted.read_value() > 0.5)[:, 0]
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
            # As after every worker answered a first piece (not timed).
            answered = tf.maximum(self.shared.issued_round.read_value(), 1)
            self.set_secs = tf.group(
                self.shared.round_secs.assign(self.secs_in),
                self.shared.issued_round.assign(answered),
                self.shared.answered.assign(answered))

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


def test_a_step_averages_every_member_weighted_by_its_slice(cluster):
    rng = np.random.default_rng(0)
    protocol = Protocol(cluster, num_workers=3)
    np.testing.assert_array_equal(protocol.join(1, 2), [1, 1, 1])
    tokens = round_tokens(protocol, 0, [1, 2])
    # Equal slices cover the global batch once, in worker order.
    assert [tuple(t[2:]) for t in tokens.values()] == [(0, 22), (22, 43),
                                                       (43, 64)]
    assert len({int(t[1]) for t in tokens.values()}) == 1  # one round
    pushes = push_all(protocol, rng, tokens)
    assert protocol.admit(tokens[0]) == (True, [0, 1, 2])
    next_step, stats = protocol.apply(0)
    assert next_step == 1
    np.testing.assert_allclose(stats, sum(p[1] for p in pushes.values()),
                               rtol=1e-6)
    assert_mean_applied(protocol, [np.zeros(n) for n in SHARDS],
                        pushes.values())
    assert protocol.read(protocol.shared.dropped) == 0
    steps, kinds, workers, members = protocol.read(protocol.records)
    assert kinds.tolist() == [state.JOINED] * 2
    assert workers.tolist() == [1, 2] and members.tolist() == [2, 3]


def test_no_step_until_every_member_has_pushed(cluster):
    rng = np.random.default_rng(1)
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    tokens = round_tokens(protocol, 0, [1])
    protocol.push(0, tokens[0], *random_push(rng, 32))
    with pytest.raises(tf.errors.DeadlineExceededError):
        protocol.admit(tokens[0], timeout_secs=1.0)
    # The admission survived the cancelled attempt: worker 1 completes it.
    protocol.push(1, tokens[1], *random_push(rng, 32))
    assert protocol.admit(tokens[0]) == (True, [0, 1])


def test_pushes_for_another_step_or_round_are_dropped_and_counted(cluster):
    rng = np.random.default_rng(2)
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    old = round_tokens(protocol, 0, [1])
    new = round_tokens(protocol, 0, [1])      # the same step, planned again
    protocol.push(1, old[1], *random_push(rng, 32))   # the old round's
    stale_step = np.array([5, new[1][1], 0, 32])
    protocol.push(1, stale_step, *random_push(rng, 32))
    pushes = push_all(protocol, rng, new)
    assert protocol.admit(new[0]) == (True, [0, 1])
    protocol.apply(0)
    assert protocol.read(protocol.shared.dropped) == 2
    assert_mean_applied(protocol, [np.zeros(n) for n in SHARDS],
                        pushes.values())


def test_a_member_lost_before_pushing_ends_the_round_unfinished(cluster):
    """Its examples are planned again among the others: the step still
    averages the whole batch."""
    rng = np.random.default_rng(3)
    protocol = Protocol(cluster, num_workers=3)
    protocol.join(1, 2)
    first = round_tokens(protocol, 0, [1, 2])
    push_all(protocol, rng, {0: first[0], 2: first[2]})
    protocol.send(state.LOST, 1)
    assert protocol.admit(first[0]) == (False, [0, 2])
    np.testing.assert_array_equal(protocol.read(protocol.shared.roster),
                                  [1, 0, 1])
    second = round_tokens(protocol, 0, [2])
    assert protocol.read(protocol.token_counts[1]) == 0  # not planned in
    assert [tuple(t[2:]) for t in second.values()] == [(0, 32), (32, 64)]
    pushes = push_all(protocol, rng, second)
    assert protocol.admit(second[0]) == (True, [0, 2])
    next_step, stats = protocol.apply(0)
    assert next_step == 1 and stats[0] == 64
    assert_mean_applied(protocol, [np.zeros(n) for n in SHARDS],
                        pushes.values())
    _, kinds, workers, members = protocol.read(protocol.records)
    assert list(zip(kinds, workers, members))[-1] == (state.LOST, 1, 2)


def test_a_push_from_a_worker_given_up_on_brings_it_back(cluster):
    rng = np.random.default_rng(4)
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    first = round_tokens(protocol, 0, [1])
    protocol.push(0, first[0], *random_push(rng, 32))
    protocol.send(state.LOST, 1)
    assert protocol.admit(first[0]) == (False, [0])
    second = {0: protocol.plan(0)}
    protocol.push(1, first[1], *random_push(rng, 32))  # late, alive after all
    protocol.push(0, second[0], *random_push(rng, 64))
    assert protocol.admit(second[0]) == (True, [0])
    assert protocol.read(protocol.shared.dropped) == 1
    np.testing.assert_array_equal(protocol.read(protocol.shared.roster),
                                  [1, 1])
    _, kinds, workers, _ = protocol.read(protocol.records)
    assert kinds.tolist()[-2:] == [state.LOST, state.JOINED]


def test_a_member_leaving_after_its_push_still_counts(cluster):
    rng = np.random.default_rng(5)
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    tokens = round_tokens(protocol, 0, [1])
    protocol.push(1, tokens[1], *random_push(rng, 32))
    protocol.send(state.LEAVING, 1)
    protocol.push(0, tokens[0], *random_push(rng, 32))
    assert protocol.admit(tokens[0]) == (True, [0, 1])
    np.testing.assert_array_equal(protocol.read(protocol.shared.roster),
                                  [1, 0])


def test_a_member_that_joins_again_was_restarted(cluster):
    """Its old self will never push: the round ends unfinished, and the
    next plan includes the new one."""
    rng = np.random.default_rng(6)
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    tokens = round_tokens(protocol, 0, [1])
    protocol.push(0, tokens[0], *random_push(rng, 32))
    protocol.send(state.JOINED, 1)
    assert protocol.admit(tokens[0]) == (False, [0])
    again = round_tokens(protocol, 0, [1])
    assert tuple(again[1][2:]) == (32, 64)


def test_backup_workers_first_members_win_and_late_ones_are_dropped(
        cluster):
    rng = np.random.default_rng(7)
    protocol = Protocol(cluster, num_workers=3, backup_workers=1, batch=63)
    protocol.join(1, 2)
    tokens = round_tokens(protocol, 0, [1, 2])
    w2 = random_push(rng, 21)
    w0 = random_push(rng, 21)
    protocol.push(2, tokens[2], *w2)
    protocol.push(0, tokens[0], *w0)
    assert protocol.admit(tokens[0]) == (True, [0, 2])
    next_step, stats = protocol.apply(0)
    assert next_step == 1 and stats[0] == 42   # the examples averaged
    assert_mean_applied(protocol, [np.zeros(n) for n in SHARDS], [w2, w0],
                        examples=42)
    protocol.push(1, tokens[1], *random_push(rng, 21))  # too late
    later = round_tokens(protocol, 1, [1, 2])
    push_all(protocol, rng, {0: later[0], 1: later[1]})
    assert protocol.admit(later[0]) == (True, [0, 1])
    assert protocol.read(protocol.shared.dropped) == 1


def test_a_laggard_sits_out_rounds_between_probes(cluster):
    """Balanced slices: a member whose rounds take over BENCH_FACTOR times
    every other member's gets no slice, except at a probe step."""
    protocol = Protocol(cluster, num_workers=3, slices="balanced")
    protocol.join(1, 2)
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.1, 0.12, 0.5]})
    tokens = round_tokens(protocol, 1, [1])
    assert protocol.read(protocol.token_counts[2]) == 0
    assert [tuple(t[2:]) for t in tokens.values()] == [(0, 32), (32, 64)]
    np.testing.assert_array_equal(protocol.read(protocol.shared.planned),
                                  [1, 1, 0])
    # At a probe step it gets a piece too, which the round does not wait
    # for: its push, however late, is timed, neither admitted nor dropped.
    rng = np.random.default_rng(8)
    probe = round_tokens(protocol, pace.PROBE_EVERY, [1, 2])
    np.testing.assert_array_equal(protocol.read(protocol.shared.planned),
                                  [1, 1, 0])
    push_all(protocol, rng, {0: probe[0], 1: probe[1]})
    assert protocol.admit(probe[0]) == (True, [0, 1])
    protocol.apply(pace.PROBE_EVERY)
    after = round_tokens(protocol, pace.PROBE_EVERY + 1, [1])
    protocol.push(2, probe[2], *random_push(rng, int(probe[2][3] -
                                                     probe[2][2])))
    push_all(protocol, rng, after)
    assert protocol.admit(after[0]) == (True, [0, 1])
    assert protocol.read(protocol.shared.dropped) == 0
    secs = protocol.read(protocol.shared.round_secs)
    assert 0 < secs[2] < 0.5   # measured: faster than it was
    # No longer a laggard by the factor: in the next round.
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.1, 0.12, 0.2]})
    back = round_tokens(protocol, PROBE_FREE_STEP, [1, 2])
    push_all(protocol, rng, back)
    assert protocol.admit(back[0]) == (True, [0, 1, 2])
    protocol.apply(PROBE_FREE_STEP)
    # A laggard again: benched a second time, its probes come twice as
    # far apart.
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.1, 0.12, 0.5]})
    for step, probed in ((3 * pace.PROBE_EVERY, False),
                         (4 * pace.PROBE_EVERY, True)):
        tokens = round_tokens(protocol, step, [1])
        assert protocol.read(protocol.token_counts[2]) == int(probed), step
        push_all(protocol, rng, tokens)
        assert protocol.admit(tokens[0]) == (True, [0, 1])
        protocol.apply(step)
    np.testing.assert_array_equal(protocol.read(protocol.shared.benched),
                                  [0, 0, 2])


def test_a_round_stops_waiting_for_a_late_minority(cluster):
    """Balanced slices: each planned round asks for a deadline; a LATE
    event for the round, with most members pushed, ends it unfinished
    and benches the late member; the step is planned again without it."""
    protocol = Protocol(cluster, num_workers=3, slices="balanced")
    protocol.join(1, 2)
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.05, 0.04, 0.06]})
    tokens = round_tokens(protocol, PROBE_FREE_STEP, [1, 2])
    steps, rounds, secs = protocol.read(protocol.deadlines)
    assert (steps[-1], rounds[-1]) == (PROBE_FREE_STEP, tokens[0][1])
    assert secs[-1] == pytest.approx(max(pace.LATE_FACTOR * 0.05,
                                         pace.MIN_LATE_SECS))
    rng = np.random.default_rng(6)
    push_all(protocol, rng, {0: tokens[0], 1: tokens[1]})
    # A LATE event of another round is ignored.
    protocol.run(protocol.late, {protocol.step_in: PROBE_FREE_STEP,
                                 protocol.round_in: tokens[0][1] - 1})
    protocol.run(protocol.late, {protocol.step_in: PROBE_FREE_STEP,
                                 protocol.round_in: tokens[0][1]})
    assert protocol.admit(tokens[0]) == (False, [0, 1])
    assert protocol.read(protocol.shared.round_secs)[2] > 0.06
    again = round_tokens(protocol, PROBE_FREE_STEP, [1])
    assert protocol.read(protocol.token_counts[2]) == 0
    np.testing.assert_array_equal(protocol.read(protocol.shared.planned),
                                  [1, 1, 0])
    push_all(protocol, rng, again)
    assert protocol.admit(again[0]) == (True, [0, 1])
    # Its late push, when it comes, is timed and not counted as dropped.
    protocol.push(2, tokens[2], *random_push(rng, int(tokens[2][3] -
                                                      tokens[2][2])))
    protocol.apply(PROBE_FREE_STEP)
    next_round = round_tokens(protocol, PROBE_FREE_STEP + 1, [1])
    push_all(protocol, rng, next_round)
    assert protocol.admit(next_round[0]) == (True, [0, 1])
    assert protocol.read(protocol.shared.dropped) == 0


def test_no_deadline_while_a_member_is_unmeasured(cluster):
    """A worker that just joined warms up in its first piece: no round
    deadline until every member has a piece time."""
    protocol = Protocol(cluster, num_workers=3, slices="balanced")
    protocol.join(1, 2)
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.05, 0.04, 0.0]})
    round_tokens(protocol, PROBE_FREE_STEP, [1, 2])
    assert protocol.read(protocol.deadline_count) == 0
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.05, 0.04, 0.06]})
    round_tokens(protocol, PROBE_FREE_STEP, [1, 2])
    assert protocol.read(protocol.deadline_count) == 1


def test_a_late_majority_is_waited_for(cluster):
    protocol = Protocol(cluster, num_workers=3, slices="balanced")
    protocol.join(1, 2)
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.05, 0.04, 0.06]})
    tokens = round_tokens(protocol, PROBE_FREE_STEP, [1, 2])
    rng = np.random.default_rng(7)
    push_all(protocol, rng, {0: tokens[0]})
    protocol.run(protocol.late, {protocol.step_in: PROBE_FREE_STEP,
                                 protocol.round_in: tokens[0][1]})
    push_all(protocol, rng, {1: tokens[1], 2: tokens[2]})
    assert protocol.admit(tokens[0]) == (True, [0, 1, 2])


def test_a_workers_first_piece_is_not_timed(cluster):
    """The first piece after a join warms the worker's session up: it sets
    no speed; the next one does, and a join again starts afresh."""
    protocol = Protocol(cluster, num_workers=2, slices="balanced")
    protocol.join(1)
    rng = np.random.default_rng(5)
    for step, measured in ((0, False), (1, True)):
        tokens = round_tokens(protocol, step, [1])
        push_all(protocol, rng, tokens)
        assert protocol.admit(tokens[0]) == (True, [0, 1])
        protocol.apply(step)
        speed = protocol.read(protocol.shared.speed)
        secs = protocol.read(protocol.shared.round_secs)
        assert bool(np.all(speed > 0)) == measured, (step, speed)
        assert bool(np.all(secs > 0)) == measured, (step, secs)
    # The speed is a ratio of averages: examples over seconds of the
    # recent pieces.
    examples = protocol.read(protocol.shared.piece_examples)
    np.testing.assert_allclose(speed, examples / secs, rtol=1e-5)
    np.testing.assert_array_equal(examples, [32, 32])
    protocol.send(state.JOINED, 1)   # worker 1 restarted
    protocol.run(protocol.absorb)
    assert protocol.read(protocol.shared.speed)[1] == 0
    assert protocol.read(protocol.shared.round_secs)[1] == 0
    assert protocol.read(protocol.shared.speed)[0] > 0


def test_a_worker_that_fell_behind_skips_to_the_newest_token(cluster):
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    for step in range(3):
        protocol.plan(step)
    assert protocol.read(protocol.token_counts[1]) == 3
    assert protocol.read(protocol.tokens[1])[0] == 2
    assert protocol.read(protocol.token_counts[1]) == 0


# --- The wire dtype: 16-bit parameters and gradients between ps and worker.

# An int64 whose four 16-bit chunks read as NaN or inf in bfloat16 and
# float16 (and a float32 whose low half does): bits must cross untouched.
NAN_CHUNKS_STEP = 0x7FC1_FF81_7F80_FFFF
NAN_LOW_HALF = np.array([0x4040_FFC1], np.uint32).view(np.float32)[0]


def round_like_wire(values, dtype):
    """float32 -> wire -> float32 in NumPy: round to nearest even."""
    values = np.asarray(values, np.float32)
    if dtype == tf.float16:
        return values.astype(np.float16).astype(np.float32)
    bits = values.view(np.uint32).astype(np.uint64)  # bfloat16; finite only
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).astype(np.uint32).view(np.float32)


def test_round_like_wire_rounds_ties_to_even():
    ties = np.float32([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-9)])
    np.testing.assert_array_equal(round_like_wire(ties, tf.bfloat16),
                                  [1.0, 1 + 2**-6, -(1 + 2**-7)])


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_16_bit_wire_rounds_values_and_keeps_token_and_stats_exact(
        cluster, dtype):
    rng = np.random.default_rng(5)
    protocol = Protocol(cluster, num_workers=2, wire_dtype=dtype, batch=63)
    params = [rng.normal(size=n).astype(np.float32) for n in SHARDS]
    protocol.set_values(params)
    odd_token = np.array([NAN_CHUNKS_STEP, 7, 3, NAN_CHUNKS_STEP], np.int64)
    token, values = protocol.read_on_worker(odd_token)
    np.testing.assert_array_equal(token, odd_token)
    for value, exact in zip(values, params):
        assert not np.array_equal(round_like_wire(exact, dtype), exact)
        np.testing.assert_array_equal(value, round_like_wire(exact, dtype))
    protocol.join(1)
    tokens = round_tokens(protocol, 0, [1])
    pushes = [random_push(rng, n) for n in (32, 31)]
    pushes[1][1][1] = NAN_LOW_HALF
    for k, (grads, stats) in enumerate(pushes):
        protocol.push(k, tokens[k], grads, stats)
    assert protocol.admit(tokens[0])[0]
    next_step, step_stats = protocol.apply(0)
    assert next_step == 1
    rows = protocol.read(protocol.shared.stats)
    np.testing.assert_array_equal(rows.view(np.uint32),
                                  np.stack([p[1] for p in pushes]).view(
                                      np.uint32))
    assert step_stats[0] == 63
    for shard, value in enumerate(protocol.values()):
        received = [round_like_wire(p[0][shard], dtype) for p in pushes]
        # The ps holds exactly the rounded gradient, in float32...
        np.testing.assert_array_equal(
            protocol.read(protocol.shared.grads[shard]), received)
        # ...and applies their float32 mean to its float32 parameters.
        expected = params[shard] - LEARNING_RATE * sum(received) / 63
        np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7)


# A fed tensor enters the graph on the client's task (worker 0) and travels
# to its placeholder's device from there: the step fed for read_params
# (on ps 0) is such a transfer of the test, not of the protocol.
_FEED = re.compile(r"_recv_read_token")


def _bytes_between_tasks(run_metadata) -> dict:
    """{(from task, to task): [bytes of each nonempty tensor received]},
    feeds left out."""
    moved = {}
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            if _FEED.search(node.timeline_label):
                continue
            match = re.match(r"\[(\d+)B\] .* from /job:(\w+)/replica:0/"
                             r"task:(\d)\S* to /job:(\w+)/replica:0/"
                             r"task:(\d)", node.timeline_label)
            if match and int(match[1]) > 0:
                key = (f"{match[2]}{match[3]}", f"{match[4]}{match[5]}")
                moved.setdefault(key, []).append(int(match[1]))
    return moved


def _cross_task_send_dtypes(run_metadata) -> set:
    """dtypes of the tensors the partitioned graphs send between tasks,
    except control messages (empty float32) and the test's step feed."""
    sent = set()
    for graph in run_metadata.partition_graphs:
        for node in graph.node:
            source, attrs = node.input[0] if node.input else "", node.attr
            if node.op == "_Send" and "/ctrl_" not in source and (
                    not _FEED.search(source)) and (
                    attrs["send_device"].s.split(b"/device")[0] !=
                    attrs["recv_device"].s.split(b"/device")[0]):
                sent.add(tf.as_dtype(attrs["T"].type))
    return sent


@pytest.mark.parametrize("dtype,width", [(tf.float32, 4), (tf.bfloat16, 2),
                                         (tf.float16, 2)])
def test_bytes_crossing_between_ps_and_worker(cluster, dtype, width):
    protocol = Protocol(cluster, num_workers=1, wire_dtype=dtype)
    token = np.array([7, 1, 0, 64], np.int64)
    feed = protocol.push_feed(token, [np.ones(n, np.float32)
                                      for n in SHARDS],
                              np.ones(3, np.float32))
    feed[protocol.read_token_in] = token
    # Parameters out (shard 0 with the 32-byte token), gradients back
    # (shard 0 with the token and three float32 stats): nothing else but
    # 0-byte control messages crosses.
    expected = {
        ("ps0", "worker0"): [5 * width + 32], ("ps1", "worker0"): [3 * width],
        ("worker0", "ps0"): [5 * width + 32 + 12],
        ("worker0", "ps1"): [3 * width]}
    # The trace's record of a transfer can come too late for its step's
    # statistics (seen about one run in ten on a loaded machine), so a run
    # missing a transfer is retried; one with wrong sizes fails every time.
    for _ in range(5):
        metadata = tf.compat.v1.RunMetadata()
        protocol.session.run(
            [protocol.read_params, protocol.pushes[0]], feed,
            options=tf.compat.v1.RunOptions(
                trace_level=tf.compat.v1.RunOptions.FULL_TRACE,
                output_partition_graphs=True),
            run_metadata=metadata)
        moved = _bytes_between_tasks(metadata)
        if moved == expected:
            break
    assert moved == expected
    # The same from the partitioned graphs: only the wire dtype crosses.
    assert _cross_task_send_dtypes(metadata) == {dtype}


@pytest.mark.parametrize("bad", [tf.int8, "float64", "bf16"])
def test_other_wire_dtypes_are_refused(bad):
    with tf.Graph().as_default(), pytest.raises(UserError, match="bfloat16"):
        transport_lib.Transport(None, bad)


# --- Ordered pulls: shard s goes to workers s, s + 1, ... (mod N) in turn.


class Turns:
    """The turn ops of ordered pulls for 3 workers and the 2 shards, fed
    with the step: `waits[k][s]` is worker k's wait for shard s,
    `passes[k]` hands on every turn worker k holds, `cover` gives turns
    to members whose predecessor is out (members fed)."""

    def __init__(self, target, num_workers=3):
        self.graph = tf.Graph()
        devices = ["/job:ps/task:0", "/job:ps/task:1"]
        with self.graph.as_default():
            turns = pull_turns.PullTurns(num_workers, devices, ordered=True)
            with tf.device(devices[0]):
                self.step_in = tf.compat.v1.placeholder(tf.int64, [])
                self.members_in = tf.compat.v1.placeholder(tf.float32,
                                                           [num_workers])
            with tf.device("/job:worker/task:0"):
                received = tf.identity(self.step_in)  # "its parameters"
            self.waits = [turns.wait(k, self.step_in)
                          for k in range(num_workers)]
            self.passes = [turns.pass_on(k, self.step_in, [received] * 2)
                           for k in range(num_workers)]
            self.cover = turns.cover_absent(self.step_in, self.members_in)
            self.queued = tf.add_n([q.size() for q in turns.queues.values()])
            self.start = turns.release_all()
        self.session = tf.compat.v1.Session(target, graph=self.graph)

    def run(self, fetch, step=None, timeout_secs=20.0, members=None):
        feed = {self.step_in: step} if step is not None else {}
        if members is not None:
            feed[self.members_in] = members
        return self.session.run(fetch, feed, options=tf.compat.v1.RunOptions(
            timeout_in_ms=int(timeout_secs * 1000)))

    def blocks(self, worker, shard, step):
        with pytest.raises(tf.errors.DeadlineExceededError):
            self.run(self.waits[worker][shard], step, timeout_secs=1.0)
        return True


def test_ordered_pulls_wait_for_the_previous_worker(cluster):
    turns = Turns(cluster)
    # The first of each order never waits: worker 0 for shard 0, 1 for 1.
    assert turns.run(turns.waits[0][0], step=0) == 0
    assert turns.run(turns.waits[1][1], step=0) == 0
    assert turns.blocks(1, 0, step=0) and turns.blocks(0, 1, step=0)
    turns.run(turns.passes[0], step=0)        # shard 0: 0 -> 1
    assert turns.run(turns.waits[1][0], step=0) == 0
    assert turns.blocks(2, 0, step=0) and turns.blocks(2, 1, step=0)
    turns.run(turns.passes[1], step=0)        # shards 0 and 1: 1 -> 2
    assert turns.run(turns.waits[2], step=0) == [0, 0]
    assert turns.blocks(0, 1, step=0)
    turns.run(turns.passes[2], step=0)        # shard 1: 2 -> 0
    assert turns.run(turns.waits[0][1], step=0) == 0
    assert turns.run(turns.queued) == 0


def test_a_stale_turn_is_skipped_and_an_absent_predecessor_covered(cluster):
    turns = Turns(cluster)
    turns.run(turns.passes[0], step=4)  # a turn worker 1 never took
    assert turns.blocks(1, 0, step=5)
    assert turns.run(turns.queued) == 0  # the stale turn is gone
    turns.run(turns.passes[0], step=5)
    assert turns.run(turns.waits[1][0], step=5) == 5
    # Worker 1 is out of the round: the plan gives worker 2 the turns
    # worker 1 would have passed (shards 0 and 1), and nobody else any.
    turns.run(turns.cover, step=6, members=[1, 0, 1])
    assert turns.run(turns.queued) == 2
    assert turns.run(turns.waits[2], step=6, timeout_secs=5.0) == [6, 6]
    assert turns.run(turns.queued) == 0


def test_a_restarted_chief_releases_workers_waiting_for_a_turn(cluster):
    """Workers wait for turns for step 9 that the old chief's run never
    passed; the new chief restored step 5 and starts from there."""
    turns = Turns(cluster)
    turns.run(turns.passes[0], step=5)  # stale by the time worker 1 waits
    assert turns.blocks(1, 0, step=9)
    turns.run(turns.start)
    assert turns.run(turns.waits, step=9) == [[9, 9]] * 3


def test_ordered_pulls_and_backup_workers_are_refused():
    config = config_lib.TrainConfig(logdir="x", ordered_pulls=True,
                                    backup_workers=1)
    with pytest.raises(UserError, match="--ordered_pulls and "
                       "--backup_workers do not mix"):
        config_lib.validate(config, num_workers=3)
