"""Ordered pulls (--ordered_pulls): each shard's turns pass from worker to
worker in order, on an in-process cluster."""

import pytest
import tensorflow as tf

from tests.sync_protocol import cluster  # noqa: F401 (a fixture)
from trainer.common import config as config_lib
from trainer.common.errors import UserError
from trainer.sync import pull_turns


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
                self.members_in = tf.compat.v1.placeholder(tf.bool,
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
    turns.run(turns.cover, step=6, members=[True, False, True])
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
