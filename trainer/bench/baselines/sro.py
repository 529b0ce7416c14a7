"""sro: the classic recipe of the TF1 tutorials, as its users write it.

    server = tf.distribute.Server(cluster, job, index)
    ps: server.join()
    worker: variables under replica_device_setter; the optimizer wrapped in
      SyncReplicasOptimizer(replicas_to_aggregate=N, total_num_replicas=N);
      MonitoredTrainingSession with the optimizer's hook and a
      StopAtStepHook; `sess.run(train_op, feed_dict=batch)` until
      should_stop.

The model, initial parameters, dropout masks, optimizer, learning rate and
global batch are the trainer's (worker k feeds slice k of global batch i at
its i-th local step). What differs is the synchronization: every worker
takes its go token from one shared queue, so a fast worker can push two
gradients for one step while a slow one pushes none, and gradients that
arrive late are dropped. Each worker therefore reports how many gradients
it pushed. The ps never returns from `server.join()` and a worker whose
last token never comes never ends: the benchmark ends them and says so.
"""

import sys
import threading
import time

from absl import logging
import numpy as np
import tensorflow as tf

from trainer.bench.baselines import common
from trainer.bench.baselines import peer
from trainer.common.config import TrainConfig
from trainer.learning import batches
from trainer.learning import optim
from trainer.learning import params as params_lib
from trainer.learning import replica as replica_lib
from trainer.learning.data import IMAGE_SIZE
from trainer.observe import progress
from trainer.observe import results


def extra_columns(leader: dict, outputs: dict, tasks: list) -> dict:
    """How many gradients each worker pushed: "index:count;..."."""
    del leader
    return {"pushed_gradients": ";".join(
        f"{t.index}:{outputs[t.name].get('pushed_gradients', '?')}"
        for t in tasks if t.job == "worker")}


# The ps tasks never return from server.join(), and a worker whose last
# token never comes never ends: the benchmark ends them.
PEER = peer.Peer(
    name="sro", order=2, label="SyncReplicasOptimizer recipe, {} worker(s)",
    help="sro (the SyncReplicasOptimizer recipe)", ps=True,
    ends_by_itself=False, extra_columns=extra_columns)


def run_task(config: TrainConfig, out_path: str, job: str, index: int,
             hosts: dict) -> None:
    """Runs ps `index` (forever) or worker `index` of the recipe."""
    cluster = tf.train.ClusterSpec({"ps": hosts["ps"],
                                    "worker": hosts["worker"]})
    server = tf.distribute.Server(
        cluster, job_name=job, task_index=index,
        config=tf.compat.v1.ConfigProto(
            intra_op_parallelism_threads=config.intra_op_threads,
            inter_op_parallelism_threads=config.inter_op_threads))
    if job == "ps":
        logging.info("ps %d serving (server.join(): never returns)", index)
        server.join()
    _run_worker(config, out_path, server, cluster, index)


def _epoch_orders(num_examples: int, seed: int):
    """epoch -> the trainer's visiting order of that epoch (int32 [n])."""
    graph = tf.Graph()
    with graph.as_default():
        epoch_in = tf.compat.v1.placeholder(tf.int64, [])
        order = batches.epoch_order(num_examples, seed, epoch_in)
    session = tf.compat.v1.Session(graph=graph)
    cache = {}

    def order_of(epoch: int) -> np.ndarray:
        if epoch not in cache:
            cache.clear()
            cache[epoch] = session.run(order, {epoch_in: epoch})
        return cache[epoch]

    return order_of


class _Graph:
    """The recipe's graph for worker `index`: feeds, train_op, hook."""

    def __init__(self, config, cluster, index, num_workers, train_steps):
        bounds = batches.shard_bounds(config.batch_size, num_workers)[index]
        self.images = tf.compat.v1.placeholder(
            tf.uint8, [None, IMAGE_SIZE, IMAGE_SIZE], "images")
        self.labels = tf.compat.v1.placeholder(tf.int32, [None], "labels")
        self.local_step = tf.compat.v1.placeholder(tf.int64, [], "step")
        setter = tf.compat.v1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{index}", cluster=cluster)
        with tf.compat.v1.device(setter):
            global_step = tf.compat.v1.train.get_or_create_global_step()
            self.flat = params_lib.FlatParams(params_lib.plan_shards(
                replica_lib.model_specs(config), cluster.num_tasks("ps")))
            values = [v.read_value() for v in self.flat.variables]
            dropout = replica_lib.global_batch_dropout(
                config.seed, self.local_step, bounds)
            logits = replica_lib.logits(config, self.flat, values,
                                        batches.model_input(self.images),
                                        dropout)
            self.stats = replica_lib.batch_stats(logits, self.labels)
            loss = self.stats[1] / self.stats[0]
            rate = optim.learning_rate(config, global_step, train_steps)
            self.optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
                optim.make_optimizer(config, rate),
                replicas_to_aggregate=num_workers,
                total_num_replicas=num_workers)
            self.train_op = self.optimizer.minimize(
                loss, global_step=global_step,
                var_list=self.flat.variables)
        self.global_step = global_step
        self.bounds, self.values = bounds, values


def _report_pushes(out_path: str, index: int,
                   state: dict) -> threading.Event:
    """Writes {"worker", "pushed_gradients"} to out_path every half second
    until the returned event is set: a worker whose last token never comes
    is killed, not ended, and its count must be on disk by then."""
    done = threading.Event()

    def loop():
        while not done.is_set():
            results.write_json(out_path, {"worker": index,
                                          "pushed_gradients": state["local"]})
            done.wait(0.5)

    threading.Thread(target=loop, daemon=True, name="report").start()
    return done


def _run_worker(config, out_path, server, cluster, index) -> None:
    num_workers = cluster.num_tasks("worker")
    is_chief = index == 0
    mnist, train_steps = common.load(config, need_test=is_chief)
    graph = tf.Graph()
    with graph.as_default():
        g = _Graph(config, cluster, index, num_workers, train_steps)
        hooks = [g.optimizer.make_session_run_hook(is_chief),
                 tf.compat.v1.train.StopAtStepHook(last_step=train_steps)]
        state = {"local": 0, "global": 0}
        # From before the wait for the chief's init; the chief writes its
        # results once at the end.
        reporting = (_report_pushes(out_path, index, state)
                     if not is_chief else threading.Event())
        with tf.compat.v1.train.MonitoredTrainingSession(
                master=server.target, is_chief=is_chief, hooks=hooks,
                save_checkpoint_secs=None, save_summaries_steps=None,
                log_step_count_steps=None,
                # The chief's token queue runner stays blocked at the end;
                # the default 120 s grace only delays the exit.
                stop_grace_period_secs=10) as session:
            pushed, outcome = _train(config, mnist, g, session, train_steps,
                                     is_chief, state)
    reporting.set()
    fields = {"worker": index, "pushed_gradients": pushed}
    if is_chief:
        common.write_results(out_path, config, train_steps, outcome,
                             **fields)
    else:  # the last token came after all: the final count
        results.write_json(out_path, fields)
    logging.info("worker %d pushed %d gradients", index, pushed)


def _train(config, mnist, g, session, train_steps: int, is_chief: bool,
           state: dict):
    """The recipe's loop; on the chief, through progress.drive, so that the
    log lines, evaluations and timings are the trainer's. Returns
    (gradients pushed, Outcome or None). `state` counts local pushes
    ("local") and holds the last global step seen ("global")."""
    order_of = _epoch_orders(len(mnist.train_labels), config.seed)
    per_epoch = batches.steps_per_epoch(len(mnist.train_labels),
                                        config.batch_size)

    def push_one() -> np.ndarray:
        i = state["local"]
        first = (i % per_epoch) * config.batch_size
        rows = order_of(i // per_epoch)[first + g.bounds[0]:
                                        first + g.bounds[1]]
        _, stats, state["global"] = session.run(
            [g.train_op, g.stats, g.global_step],
            {g.images: mnist.train_images[rows],
             g.labels: mnist.train_labels[rows].astype(np.int32),
             g.local_step: i})
        state["local"] += 1
        return stats

    if not is_chief:
        while not session.should_stop():
            push_one()
        return state["local"], None

    def run_steps(start: int, count: int) -> dict:
        stats = np.zeros(replica_lib.NUM_STATS)
        while state["global"] < start + count and not session.should_stop():
            stats += push_one()
        return {"stats": stats}

    evaluator = _LocalEvaluator(config, g.flat, mnist)

    def evaluate() -> dict:
        # The raw session: the hooks' session refuses runs once the
        # StopAtStepHook has asked to stop (the final evaluation).
        return evaluator(session.run_step_fn(
            lambda step_context: step_context.session.run(g.values)))

    started = time.monotonic()
    outcome = progress.drive(run_steps, evaluate, None, config, 0,
                             train_steps, None)
    logging.info("chief trained %d global steps in %.0f s", train_steps,
                 time.monotonic() - started)
    return state["local"], outcome


class _LocalEvaluator:
    """Test loss and accuracy of parameter values, in a graph and session
    of this process alone (MonitoredTrainingSession would initialize the
    test set's variables without their values)."""

    def __init__(self, config: TrainConfig, layout, mnist):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.values_in = [tf.compat.v1.placeholder(tf.float32, [n])
                              for n in layout.sizes]
            self.outputs, init = replica_lib.evaluation(
                config, layout, self.values_in, len(mnist.test_labels))
        self.session = tf.compat.v1.Session(graph=self.graph)
        init(self.session, mnist.test_images, mnist.test_labels)

    def __call__(self, values: list) -> dict:
        out = self.session.run(self.outputs,
                               dict(zip(self.values_in, values)))
        return {k: float(v) for k, v in out.items()}


if __name__ == "__main__":
    sys.exit(peer.main(PEER, run_task))
