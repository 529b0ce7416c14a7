"""Running one task: a ps that serves until told to stop, or a worker.

`run(config, task)` is the library entry point; `trainer.main` only parses
flags and calls it. The chief (worker 0) initializes or restores the
parameters, runs the update, evaluates, checkpoints, writes TensorBoard
summaries and results.json, and at the end tells every ps task to exit.
"""

import dataclasses
import json
import os
import pathlib
import resource
import socket
import time

from absl import logging
import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from trainer import data as data_lib
from trainer import graph as graph_lib
from trainer import progress
from trainer import sync as sync_lib
from trainer.cluster import Task, split_address
from trainer.config import TrainConfig, validate
from trainer.errors import RunFailed, UserError

POLL_SECS = 0.25           # how often to look for a ps or the chief
PROGRESS_LOG_SECS = 5.0    # how often to say we are still waiting
FINISH_WAIT_SECS = 15.0    # how long the chief waits for workers' reports
RESULTS_FILE = "results.json"


def run(config: TrainConfig, task: Task) -> None:
    """Runs this task to the end of training; raises UserError/RunFailed."""
    validate(config, task.cluster.num_workers)
    check_port_free(task)
    if task.job_name == "ps":
        serve_ps(config, task, start_server(config, task))
        return
    # Read the data first: a bad file should stop this task before its
    # server is up.
    data_dir = data_lib.resolve_data_dir(config.data_dir)
    mnist = data_lib.load(data_dir, config.download, need_test=task.is_chief)
    logging.info("data: %d training and %d test images from %s",
                 len(mnist.train_labels), len(mnist.test_labels), data_dir)
    Worker(config, task, start_server(config, task)).run(mnist)


def start_server(config: TrainConfig, task: Task):
    return tf.distribute.Server(
        tf.train.ClusterSpec(task.cluster.as_dict()), job_name=task.job_name,
        task_index=task.task_index,
        config=graph_lib.session_config(config, task))


def check_port_free(task: Task) -> None:
    """Fails clearly if this task's port is taken on this machine.

    TensorFlow's server would otherwise fail with a gRPC error deep inside,
    or, as gRPC sets SO_REUSEPORT, share the port with the other process.
    """
    _, port = split_address(task.address, "this task's address")
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("", port))
    except OSError:
        raise UserError(
            f"port {port} of {task.describe()} is already in use on this "
            "machine; stop the process that holds it or give this task "
            "another port") from None
    finally:
        probe.close()


def wait_for_ps(task: Task, timeout: float) -> None:
    """Waits until every ps task accepts connections, logging progress."""
    start = time.monotonic()
    pending = list(range(task.cluster.num_ps))
    next_log = start + PROGRESS_LOG_SECS
    while pending:
        for index in list(pending):
            host, port = split_address(task.cluster.ps[index], "--ps_hosts")
            try:
                socket.create_connection((host.strip("[]"), port),
                                         timeout=1.0).close()
                pending.remove(index)
            except OSError:
                pass
        now = time.monotonic()
        if pending and now - start > timeout:
            names = ", ".join(task.cluster.describe("ps", i) for i in pending)
            raise RunFailed(
                f"{names} did not start within {timeout:.0f} s "
                "(--startup_timeout_secs); start it (run_ps.sh) or fix "
                "--ps_hosts")
        if pending and now >= next_log:
            names = ", ".join(task.cluster.describe("ps", i) for i in pending)
            logging.info("waiting for %s to start: %.0f s", names,
                         now - start)
            next_log = now + PROGRESS_LOG_SECS
        if pending:
            time.sleep(POLL_SECS)


def serve_ps(config: TrainConfig, task: Task, server) -> None:
    """Serves variables until the chief puts an element in our queue.

    `server.join()` would never return; instead the ps runs a dequeue on its
    own shutdown queue, a second at a time so that signals get through.
    """
    graph = tf.Graph()
    with graph.as_default(), tf.device(graph_lib.ps_device(task.task_index)):
        wait = sync_lib.shutdown_queue(task.task_index).dequeue()
    options = tf.compat.v1.RunOptions(timeout_in_ms=1000)
    with tf.compat.v1.Session(server.target, graph=graph,
                              config=graph_lib.session_config(config, task)
                              ) as session:
        logging.info("%s serving", task.describe())
        while True:
            try:
                session.run(wait, options=options)
                break
            except tf.errors.DeadlineExceededError:
                continue
    logging.info("%s: the chief reported the end of training; exiting",
                 task.describe())


class Worker:
    """The Python side of one worker: start-up, the loop, the end."""

    def __init__(self, config: TrainConfig, task: Task, server):
        self.config = config
        self.task = task
        self.server = server
        self.is_chief = task.is_chief
        self.k = task.task_index

    # --- Setting up ---

    def run(self, mnist: data_lib.Mnist) -> None:
        config = self.config
        self.train_steps = config.resolved_train_steps(len(mnist.train_labels))
        logging.info("%d global steps of %d images", self.train_steps,
                     config.batch_size)
        self.g = graph_lib.build_worker(
            config, self.task, len(mnist.train_labels),
            max(len(mnist.test_labels), 1), self.train_steps)
        wait_for_ps(self.task, config.startup_timeout_secs)
        self.session = tf.compat.v1.Session(
            self.server.target, graph=self.g.graph,
            config=graph_lib.session_config(config, self.task))
        self.g.trainset.initialize(self.session, mnist.train_images,
                                   mnist.train_labels)
        if self.is_chief:
            self.g.testset_init(self.session, mnist.test_images,
                                mnist.test_labels)
        del mnist
        # Saver.save and .restore build nothing here, but look at the
        # default graph to decide between graph and eager mode.
        with self.g.graph.as_default():
            if self.is_chief:
                self.run_chief()
            else:
                self.run_follower()

    def _callable(self, fetches, feeds=(), timeout_secs=None):
        return make_callable(self.session, fetches, feeds, timeout_secs)

    # --- The chief ---

    def run_chief(self) -> None:
        g = self.g
        logdir = pathlib.Path(self.config.logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        step = self._initialize_or_restore(logdir)
        self.session.run(g.start_op)
        self.session.run(g.mark_ready_op)
        logging.info("chief ready at global step %d of %d", step,
                     self.train_steps)
        writer = progress.summary_writer(str(logdir), g.graph)
        loop = self._callable(g.loop_outputs, [g.start_step, g.num_steps])

        def run_steps(start: int, count: int) -> dict:
            out = loop(start, count)
            if out["steps_done"] != count or out["next_step"] != start + count:
                raise RunFailed(f"the training loop stopped early at step "
                                f"{out['next_step']}")
            return out

        first_step = step
        outcome = progress.drive(
            run_steps, self._callable(g.eval_outputs),
            lambda at: self._save(logdir, at), self.config, step,
            self.train_steps, writer)
        writer.close()
        local_steps = self._collect_finished()
        self._write_results(logdir, self.train_steps - first_step, outcome,
                            local_steps)
        self._shut_down_ps()
        self.session.close()

    def _initialize_or_restore(self, logdir: pathlib.Path) -> int:
        g = self.g
        latest = tf.train.latest_checkpoint(str(logdir))
        if latest:
            check_checkpoint_matches(latest, g.checkpoint_shapes,
                                     self.config.model)
            g.saver.restore(self.session, latest)
            self.session.run(g.transient_init_op)
            step = int(self.session.run(g.global_step))
            logging.info("restored %s (global step %d)", latest, step)
        else:
            self.session.run(g.init_op)
            step = int(self.session.run(g.global_step))
            logging.info("initialized the parameters (no checkpoint in %s)",
                         logdir)
            self._save(logdir, step)
        return step

    def _save(self, logdir: pathlib.Path, step: int) -> None:
        path = self.g.saver.save(self.session, str(logdir / "model.ckpt"),
                                 global_step=step, write_meta_graph=False)
        logging.info("saved checkpoint %s", path)

    def _collect_finished(self) -> dict:
        """Local step counts that the other workers report as they finish."""
        take = self._callable({"worker": self.g.take_finished[0],
                               "steps": self.g.take_finished[1]},
                              timeout_secs=1.0)
        reports = {}
        deadline = time.monotonic() + FINISH_WAIT_SECS
        while (len(reports) < self.task.cluster.num_workers - 1
               and time.monotonic() < deadline):
            try:
                out = take()
            except tf.errors.DeadlineExceededError:
                continue
            reports[int(out["worker"])] = int(out["steps"])
        missing = [k for k in range(1, self.task.cluster.num_workers)
                   if k not in reports]
        if missing:
            logging.warning("no end-of-training report from %s",
                            ", ".join(self.task.cluster.describe("worker", k)
                                      for k in missing))
        return reports

    def _write_results(self, logdir, steps_trained,
                       outcome: progress.Outcome, local_steps) -> None:
        config = self.config
        cluster = self.task.cluster
        results = {
            "final_test_accuracy": outcome.history[-1]["accuracy"],
            "final_test_loss": outcome.history[-1]["loss"],
            "global_step": self.train_steps,
            "train_steps": self.train_steps,
            "steps_this_run": steps_trained,
            **outcome.summary(config.batch_size),
            "num_workers": cluster.num_workers,
            "num_ps": cluster.num_ps,
            "replicas_to_aggregate": config.replicas_to_aggregate(
                cluster.num_workers),
            "backup_workers": config.backup_workers,
            "dropped_gradients": outcome.dropped,
            "local_steps": {"0": steps_trained,
                            **{str(k): v for k, v in local_steps.items()}},
            "peak_rss_mb": peak_rss_mb(),
            "eval_history": outcome.history,
            "flags": dataclasses.asdict(config),
            "cluster": cluster.as_dict(),
        }
        tmp = logdir / (RESULTS_FILE + ".tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        os.replace(tmp, logdir / RESULTS_FILE)
        logging.info("final test accuracy %.2f%% after %d steps; wrote %s",
                     100 * results["final_test_accuracy"], self.train_steps,
                     logdir / RESULTS_FILE)

    def _shut_down_ps(self) -> None:
        options = tf.compat.v1.RunOptions(timeout_in_ms=5000)
        for i, op in enumerate(self.g.shutdown_ops):
            try:
                self.session.run(op, options=options)
            except tf.errors.OpError as e:
                logging.warning("could not tell %s to exit: %s",
                                self.task.cluster.describe("ps", i),
                                e.message.splitlines()[0])

    # --- Other workers ---

    def run_follower(self) -> None:
        g = self.g
        self._wait_for_chief()
        step = int(self.session.run(g.resync_step))
        loop = self._callable(g.loop_outputs, [g.start_step, g.num_steps])
        local_steps = 0
        logging.info("worker %d starts at global step %d", self.k, step)
        while 0 <= step < self.train_steps:
            out = loop(step, self.config.log_every)
            local_steps += int(out["steps_done"])
            step = int(out["next_step"])
            logging.info("worker %d: global step %d, %d local steps",
                         self.k, max(step, 0), local_steps)
        if step == sync_lib.STOP:
            reason = self.session.run(g.stop_reason).decode()
            raise RunFailed(f"the chief stopped the run: {reason}")
        self.session.run(g.finish_op, {g.local_steps_in: local_steps})
        logging.info("worker %d finished: %d local steps", self.k, local_steps)
        self.session.close()

    def _wait_for_chief(self) -> None:
        chief = self.task.cluster.describe("worker", 0)
        start = time.monotonic()
        next_log = start + PROGRESS_LOG_SECS
        while not self.session.run(self.g.ready):
            now = time.monotonic()
            if now - start > self.config.startup_timeout_secs:
                raise RunFailed(
                    f"the chief, {chief}, did not initialize the variables "
                    f"within {self.config.startup_timeout_secs:.0f} s "
                    "(--startup_timeout_secs); start it or check "
                    "--worker_hosts")
            if now >= next_log:
                logging.info("waiting for the chief, %s, to initialize the "
                             "variables: %.0f s", chief, now - start)
                next_log = now + PROGRESS_LOG_SECS
            time.sleep(POLL_SECS)
        theirs = self.session.run(self.g.chief_fingerprint).decode()
        ours = self.g.sync.fingerprint
        if theirs != ours:
            raise RunFailed(
                f"this worker's settings differ from the chief's: chief has "
                f"'{_first_difference(theirs, ours)[0]}', this worker has "
                f"'{_first_difference(theirs, ours)[1]}'; start every task "
                "with the same cluster and training flags")


def make_callable(session, fetches: dict, feeds=(), timeout_secs=None):
    """A C++ callable for `fetches` (no per-call Python feed handling).

    Feeds are int64 scalars given positionally; the result is a dict like
    `fetches`.
    """
    options = config_pb2.CallableOptions()
    for tensor in feeds:
        options.feed.append(tensor.name)
    names = {key: tensor.name for key, tensor in fetches.items()}
    for name in names.values():
        options.fetch.append(name)
    if timeout_secs:
        options.run_options.timeout_in_ms = int(timeout_secs * 1000)
    call = session._make_callable_from_options(options)

    def run(*args):
        values = call(*[np.asarray(a, np.int64) for a in args])
        return dict(zip(names, values))

    return run


def check_checkpoint_matches(path: str, expected: dict, model: str) -> None:
    """Refuses a checkpoint whose entries do not fit this model."""
    found = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    for name, shape in sorted(expected.items()):
        if name not in found:
            raise UserError(
                f"checkpoint {path} does not fit --model={model}: it has no "
                f"'{name}' {shape}; use a new --logdir, or the flags that "
                "wrote this checkpoint")
        if list(found[name]) != list(shape):
            raise UserError(
                f"checkpoint {path} does not fit --model={model}: "
                f"'{name}' is {list(found[name])} there but {shape} here; "
                "use a new --logdir, or the flags that wrote this checkpoint")


def _first_difference(a: str, b: str) -> tuple[str, str]:
    for x, y in zip(a.split(), b.split()):
        if x != y:
            return x, y
    return a, b


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
