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
from trainer.sync import averaging as sync
from trainer.common.errors import UserError

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
    """Averaging plus feedable pushes and reads, one update, and probes."""

    def __init__(self, target, num_workers, replicas,
                 wire_dtype=tf.float32):
        self.graph = tf.Graph()
        devices = ["/job:ps/task:0", "/job:ps/task:1"]
        with self.graph.as_default():
            self.state = sync.Averaging(num_workers, replicas, SHARDS,
                                        devices, wire_dtype)
            self.params = []
            for i, n in enumerate(SHARDS):
                with tf.device(devices[i]):
                    self.params.append(tf.compat.v1.get_variable(
                        f"params_{i}", [n], initializer=tf.zeros_initializer(),
                        use_resource=True))
            with tf.device(devices[0]):
                self.read_step_in = tf.compat.v1.placeholder(
                    tf.int64, [], "read_step")
                read_step = tf.identity(self.read_step_in)
            with tf.device("/job:worker/task:0"):
                self.step_in = tf.compat.v1.placeholder(tf.int64, [])
                self.grads_in = [tf.compat.v1.placeholder(tf.float32, [n])
                                 for n in SHARDS]
                self.stats_in = tf.compat.v1.placeholder(tf.float32, [3])
                self.read_params = self.state.pull(read_step,
                                                          self.params)
            self.pushes = [self.state.push(k, self.step_in, self.grads_in,
                                           self.stats_in)
                           for k in range(num_workers)]
            self.params_in = [tf.compat.v1.placeholder(tf.float32, [n])
                              for n in SHARDS]
            self.set_params = [p.assign(v, read_value=False)
                               for p, v in zip(self.params, self.params_in)]
            with tf.device(devices[0]):
                step = self.state.global_step.read_value()
                mean, self.step_stats = self.state.average(
                    self.state.admit(step))
                optimizer = tf.compat.v1.train.GradientDescentOptimizer(
                    LEARNING_RATE)
                update = optimizer.apply_gradients(zip(mean, self.params))
                self.next_step = self.state.count_and_advance(step, [update])
                self.token_counts = [q.size() for q in self.state.tokens]
                self.tokens = [self.state.next_token(k)
                               for k in range(num_workers)]
            init = tf.compat.v1.global_variables_initializer()
            start = self.state.start_op()
        self.session = tf.compat.v1.Session(target, graph=self.graph)
        self.session.run(init)
        self.session.run(start)

    def push_feed(self, step, grads, stats):
        feed = {self.step_in: step, self.stats_in: stats}
        feed.update(dict(zip(self.grads_in, grads)))
        return feed

    def push(self, worker, step, grads, stats):
        self.session.run(self.pushes[worker],
                         self.push_feed(step, grads, stats))

    def set_values(self, values):
        self.session.run(self.set_params, dict(zip(self.params_in, values)))

    def read_on_worker(self, step):
        """(step, shard values) as read_params gives them to the worker."""
        return self.session.run(self.read_params, {self.read_step_in: step})

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
def test_16_bit_wire_rounds_values_and_keeps_step_and_stats_exact(
        cluster, dtype):
    rng = np.random.default_rng(5)
    protocol = Protocol(cluster, num_workers=2, replicas=2, wire_dtype=dtype)
    params = [rng.normal(size=n).astype(np.float32) for n in SHARDS]
    protocol.set_values(params)
    step, values = protocol.read_on_worker(NAN_CHUNKS_STEP)
    assert step == NAN_CHUNKS_STEP
    for value, exact in zip(values, params):
        assert not np.array_equal(round_like_wire(exact, dtype), exact)
        np.testing.assert_array_equal(value, round_like_wire(exact, dtype))
    pushes = [random_push(rng, n) for n in (32, 31)]
    pushes[1][1][1] = NAN_LOW_HALF
    for k, (grads, stats) in enumerate(pushes):
        protocol.push(k, 0, grads, stats)
    next_step, step_stats = protocol.update()
    assert next_step == 1
    rows = protocol.read(protocol.state.stats)
    np.testing.assert_array_equal(rows.view(np.uint32),
                                  np.stack([p[1] for p in pushes]).view(
                                      np.uint32))
    assert step_stats[0] == 63
    for shard, value in enumerate(protocol.values()):
        received = [round_like_wire(p[0][shard], dtype) for p in pushes]
        # The ps holds exactly the rounded gradient, in float32...
        np.testing.assert_array_equal(
            protocol.read(protocol.state.grads[shard]), received)
        # ...and applies their float32 mean to its float32 parameters.
        expected = params[shard] - LEARNING_RATE * sum(received) / 63
        np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7)


# A fed tensor enters the graph on the client's task (worker 0) and travels
# to its placeholder's device from there: the step fed for read_params
# (on ps 0) is such a transfer of the test, not of the protocol.
_FEED = re.compile(r"_recv_read_step")


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
    protocol = Protocol(cluster, num_workers=1, replicas=1, wire_dtype=dtype)
    feed = protocol.push_feed(7, [np.ones(n, np.float32) for n in SHARDS],
                              np.ones(3, np.float32))
    feed[protocol.read_step_in] = 7
    # Parameters out (shard 0 with the 8-byte step), gradients back (shard
    # 0 with the step and three float32 stats): nothing else but 0-byte
    # control messages crosses.
    expected = {
        ("ps0", "worker0"): [5 * width + 8], ("ps1", "worker0"): [3 * width],
        ("worker0", "ps0"): [5 * width + 8 + 12],
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
        sync.Averaging(1, 1, SHARDS, ["/job:ps/task:0"] * 2, bad)


# --- Ordered pulls: shard s goes to workers s, s + 1, ... (mod N) in turn.


class PullTurns:
    """The turn ops of Averaging(ordered_pulls=True) for 3 workers and the
    2 shards, fed with the step: `waits[k][s]` is worker k's wait for
    shard s, `passes[k]` hands on every turn worker k holds."""

    def __init__(self, target, num_workers=3):
        self.graph = tf.Graph()
        devices = ["/job:ps/task:0", "/job:ps/task:1"]
        with self.graph.as_default():
            self.state = sync.Averaging(num_workers, num_workers, SHARDS,
                                        devices, ordered_pulls=True)
            turns = self.state.pull_turns
            with tf.device(devices[0]):
                self.step_in = tf.compat.v1.placeholder(tf.int64, [])
            with tf.device("/job:worker/task:0"):
                received = tf.identity(self.step_in)  # "its parameters"
            self.waits = [turns.wait(k, self.step_in)
                          for k in range(num_workers)]
            self.passes = [turns.pass_on(k, self.step_in, [received] * 2)
                           for k in range(num_workers)]
            self.resyncs = [self.state.resync_step(k)
                            for k in range(num_workers)]
            self.queued = tf.add_n([q.size() for q in turns.queues.values()])
            self.start = self.state.start_op()
            init = tf.compat.v1.global_variables_initializer()
        self.session = tf.compat.v1.Session(target, graph=self.graph)
        self.session.run(init)

    def run(self, fetch, step=None, timeout_secs=20.0):
        return self.session.run(
            fetch, {self.step_in: step} if step is not None else None,
            options=tf.compat.v1.RunOptions(
                timeout_in_ms=int(timeout_secs * 1000)))

    def blocks(self, worker, shard, step):
        with pytest.raises(tf.errors.DeadlineExceededError):
            self.run(self.waits[worker][shard], step, timeout_secs=1.0)
        return True


def test_ordered_pulls_wait_for_the_previous_worker(cluster):
    turns = PullTurns(cluster)
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


def test_a_stale_turn_is_skipped_and_a_restart_takes_its_own(cluster):
    turns = PullTurns(cluster)
    turns.run(turns.passes[0], step=4)  # a turn worker 1 never took
    assert turns.blocks(1, 0, step=5)
    assert turns.run(turns.queued) == 0  # the stale turn is gone
    turns.run(turns.passes[0], step=5)
    assert turns.run(turns.waits[1][0], step=5) == 5
    # Worker 2 restarts at global step 0: it need not wait for worker 1.
    assert turns.run(turns.resyncs[2]) == 0
    assert turns.run(turns.waits[2], step=0, timeout_secs=5.0) == [0, 0]


def test_a_restarted_chief_releases_workers_waiting_for_a_turn(cluster):
    """Workers wait for turns for step 9 that the old chief's run never
    passed; the new chief restored step 5 and starts from there."""
    turns = PullTurns(cluster)
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
