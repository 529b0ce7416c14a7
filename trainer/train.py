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
from trainer import model as model_lib
from trainer import params as params_lib
from trainer import progress
from trainer import sync as sync_lib
from trainer import watchdog as watchdog_lib
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
    # Check the data and the logdir first: bad input should stop this task
    # before its server is up.
    if task.is_chief:
        check_logdir_fits_model(config)
    data_dir = data_lib.resolve_data_dir(config.data_dir)
    mnist = data_lib.load(data_dir, config.download,
                          data_lib.mirror_list(config.data_url),
                          need_test=task.is_chief)
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
    next_log = start  # say at once what we wait for, then every few secs
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
                status = session.run(wait, options=options)
                break
            except tf.errors.DeadlineExceededError:
                continue
    if status:
        raise RunFailed("the chief stopped the run after an error; see its "
                        "log")
    logging.info("%s: the chief reported the end of training; exiting",
                 task.describe())


# Errors a task sees when a ps task died or restarted (connection refused,
# session or graph handle gone, variables gone or not yet initialized).
PS_LOST = (tf.errors.UnavailableError, tf.errors.AbortedError,
           tf.errors.NotFoundError, tf.errors.FailedPreconditionError,
           tf.errors.CancelledError, tf.errors.InternalError)


class Worker:
    """The Python side of one worker: start-up, the loop, the end.

    A worker that loses the ps tasks (one died or restarted) reconnects:
    it waits for them, opens a new session and goes on; the chief first
    restores the latest checkpoint, since a restarted ps has lost the
    variables. It gives up if no step succeeds for --startup_timeout_secs.
    """

    def __init__(self, config: TrainConfig, task: Task, server):
        self.config = config
        self.task = task
        self.server = server
        self.is_chief = task.is_chief
        self.k = task.task_index
        self.session = None
        self.stop_reason = None   # set by the watchdog when it gives up
        self.local_steps = 0

    # --- Setting up and reconnecting ---

    def run(self, mnist: data_lib.Mnist) -> None:
        config = self.config
        self.mnist = mnist
        self.train_steps = config.resolved_train_steps(len(mnist.train_labels))
        logging.info("%d global steps of %d images", self.train_steps,
                     config.batch_size)
        self.g = graph_lib.build_worker(
            config, self.task, len(mnist.train_labels),
            max(len(mnist.test_labels), 1), self.train_steps)
        self.last_progress = time.monotonic()
        # Saver.save and .restore build nothing here, but look at the
        # default graph to decide between graph and eager mode.
        with self.g.graph.as_default():
            while True:
                try:
                    self._connect()
                    if self.is_chief:
                        self.run_chief()
                    else:
                        self.run_follower()
                    return
                except Exception as e:  # noqa: BLE001 (re-raised below)
                    if self.stop_reason:  # the watchdog closed the session
                        raise RunFailed(self.stop_reason) from None
                    if not isinstance(e, PS_LOST):
                        raise
                    self._handle_lost(e)

    def _connect(self) -> None:
        wait_for_ps(self.task, self.config.startup_timeout_secs)
        self.session = tf.compat.v1.Session(
            self.server.target, graph=self.g.graph,
            config=graph_lib.session_config(self.config, self.task))
        self.g.trainset.initialize(self.session, self.mnist.train_images,
                                   self.mnist.train_labels)
        if self.is_chief:
            self.g.testset_init(self.session, self.mnist.test_images,
                                self.mnist.test_labels)

    def _handle_lost(self, error: tf.errors.OpError) -> None:
        """Closes the broken session; fails if nothing has worked for long."""
        self._close_session()
        first_line = error_summary(error)
        if time.monotonic() - self.last_progress > (
                self.config.startup_timeout_secs):
            raise RunFailed(
                f"no training step succeeded for "
                f"{self.config.startup_timeout_secs:.0f} s "
                f"(--startup_timeout_secs); last error: {first_line}"
                ) from None
        logging.warning("lost the ps tasks (%s); reconnecting", first_line)

    def _close_session(self) -> None:
        if self.session is not None:
            try:
                self.session.close()
            except Exception:  # the ps may be gone already
                pass
            self.session = None

    def _callable(self, fetches, feeds=()):
        return make_callable(self.session, fetches, feeds)

    def _watchdog(self, timeout_secs: float, on_timeout) -> watchdog_lib.Watchdog:
        read = self._callable({"step": self.g.global_step,
                               "admitted": self.g.admitted})
        cluster = self.task.cluster

        def read_progress():
            out = read()
            return int(out["step"]), list(out["admitted"])

        def describe_missing(admitted) -> str:
            missing = [k for k, flag in enumerate(admitted)
                       if flag < 0.5 and k != self.k]
            if not missing:
                return "the chief to apply the step"
            return ", ".join(cluster.describe("worker", k) for k in missing)

        return watchdog_lib.Watchdog(read_progress, describe_missing,
                                     timeout_secs, on_timeout)

    def _give_up(self, reason: str) -> None:
        """From the watchdog: end the blocked session.run with a reason."""
        self.stop_reason = reason
        session, self.session = self.session, None
        session.close()  # cancels the step the main thread is blocked in

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
        with self._watchdog(self.config.worker_timeout_secs,
                            lambda at, who: self._stop_stalled_run(
                                logdir, at, who)) as dog:

            def run_steps(start: int, count: int) -> dict:
                # The first step also waits for every worker to start.
                with dog.busy(self.config.startup_timeout_secs
                              if start == step else None):
                    out = loop(start, count)
                if out["steps_done"] != count or (
                        out["next_step"] != start + count):
                    raise RunFailed(f"the training loop stopped early at "
                                    f"step {out['next_step']}")
                self.last_progress = time.monotonic()
                return out

            outcome = progress.drive(
                run_steps, self._callable(g.eval_outputs),
                lambda at: self._save(logdir, at), self.config, step,
                self.train_steps, writer)
        writer.close()
        local_steps = self._collect_finished()
        self._write_results(logdir, self.train_steps - step, outcome,
                            local_steps)
        self._shut_down_ps()
        self._close_session()

    def _stop_stalled_run(self, logdir: pathlib.Path, step: int,
                          who: str) -> None:
        """The step waited --worker_timeout_secs for `who`: save and stop.

        The blocked step has not been applied, so the parameters are those
        after `step` steps: a consistent checkpoint to resume from.
        """
        reason = (f"{who} sent no gradient for step {step} in "
                  f"{self.config.worker_timeout_secs:.0f} s "
                  "(--worker_timeout_secs)")
        with self.g.graph.as_default():
            try:
                self._save(logdir, step)
                self.session.run(self.g.stop_op,
                                 {self.g.stop_reason_in: reason})
                self._shut_down_ps(failed=True)
            except tf.errors.OpError as e:
                logging.warning("could not save or stop cleanly: %s",
                                error_summary(e))
        self._give_up(
            f"{reason}; stopped the run after saving a checkpoint at step "
            f"{step}; restart the missing task(s) and start every task again "
            "with the same flags to continue from it")

    def _initialize_or_restore(self, logdir: pathlib.Path) -> int:
        g = self.g
        latest = tf.train.latest_checkpoint(str(logdir))
        if latest:
            check_checkpoint_matches(latest, g.checkpoint_shapes,
                                     self.config.model)
            restored = self._restore(logdir)
            self.session.run(g.transient_init_op)
            step = int(self.session.run(g.global_step))
            logging.info("restored %s (global step %d)", restored, step)
        else:
            self.session.run(g.init_op)
            step = int(self.session.run(g.global_step))
            logging.info("initialized the parameters (no checkpoint in %s)",
                         logdir)
            self._save(logdir, step)
        return step

    def _restore(self, logdir: pathlib.Path) -> str:
        """Restores the newest readable checkpoint; returns its path.

        A checkpoint that cannot be read (cut short by a crash or a full
        disk) is skipped, with a warning, for the one before it. If none
        can be read the run stops rather than start over on top of them.
        """
        state = tf.train.get_checkpoint_state(str(logdir))
        paths = list(state.all_model_checkpoint_paths)
        for path in reversed(paths):
            files = tf.io.gfile.glob(path + ".*")
            if not any(f.endswith(".index") for f in files) or not any(
                    ".data-" in f for f in files):
                logging.warning("checkpoint %s has missing files; trying the "
                                "one before it", path)
                continue
            try:
                self.g.saver.restore(self.session, path)
                return path
            except (tf.errors.DataLossError, tf.errors.OutOfRangeError,
                    tf.errors.InvalidArgumentError) as e:
                logging.warning("cannot restore %s (%s); trying the "
                                "checkpoint before it", path,
                                error_summary(e))
        raise UserError(
            f"none of the {len(paths)} checkpoint(s) in {logdir} can be "
            "read; move them elsewhere to start over, or give another "
            "--logdir")

    def _save(self, logdir: pathlib.Path, step: int) -> None:
        path = self.g.saver.save(self.session, str(logdir / "model.ckpt"),
                                 global_step=step, write_meta_graph=False)
        logging.info("saved checkpoint %s", path)

    def _collect_finished(self) -> dict:
        """Local step counts that the other workers report as they finish."""
        options = tf.compat.v1.RunOptions(timeout_in_ms=1000)
        reports = {}
        deadline = time.monotonic() + FINISH_WAIT_SECS
        while (len(reports) < self.task.cluster.num_workers - 1
               and time.monotonic() < deadline):
            try:
                worker, steps = self.session.run(self.g.take_finished,
                                                 options=options)
            except tf.errors.DeadlineExceededError:
                continue
            reports[int(worker)] = int(steps)
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

    def _shut_down_ps(self, failed: bool = False) -> None:
        """Tells every ps task to exit (with status 1 if the run failed)."""
        options = tf.compat.v1.RunOptions(timeout_in_ms=5000)
        for i, op in enumerate(self.g.shutdown_ops):
            try:
                self.session.run(op, {self.g.shutdown_status: int(failed)},
                                 options=options)
            except tf.errors.OpError as e:
                logging.warning("could not tell %s to exit: %s",
                                self.task.cluster.describe("ps", i),
                                error_summary(e))

    # --- Other workers ---

    def run_follower(self) -> None:
        g = self.g
        self._wait_for_chief()
        step = int(self.session.run(g.resync_step))
        loop = self._callable(g.loop_outputs, [g.start_step, g.num_steps])
        logging.info("worker %d starts at global step %d", self.k, step)
        # The chief gives up on a missing worker after --worker_timeout_secs
        # and tells us why; we wait twice that long for it to do so.
        timeout = 2 * self.config.worker_timeout_secs
        with self._watchdog(timeout, lambda at, who: self._give_up(
                f"global step {at} did not move for {timeout:.0f} s "
                f"(2 x --worker_timeout_secs), waiting for {who}; is the "
                f"chief, {self.task.cluster.describe('worker', 0)}, "
                "running?")) as dog:
            while 0 <= step < self.train_steps:
                with dog.busy():
                    out = loop(step, self.config.log_every)
                self.last_progress = time.monotonic()
                self.local_steps += int(out["steps_done"])
                step = int(out["next_step"])
                logging.info("worker %d: global step %d, %d local steps",
                             self.k, max(step, 0), self.local_steps)
        if step == sync_lib.STOP:
            reason = self.session.run(g.stop_reason).decode()
            raise RunFailed(f"the chief stopped the run: {reason}")
        self.session.run(g.finish_op, {g.local_steps_in: self.local_steps})
        logging.info("worker %d finished: %d local steps", self.k,
                     self.local_steps)
        self._close_session()

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


def error_summary(error: Exception) -> str:
    """The first informative line of a TensorFlow error, shortened."""
    text = str(getattr(error, "message", None) or error)
    for line in text.splitlines():
        line = line.strip()
        if line and set(line) != {"="}:
            return line[:200]
    return type(error).__name__


def make_callable(session, fetches: dict, feeds=()):
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
    call = session._make_callable_from_options(options)

    def run(*args):
        values = call(*[np.asarray(a, np.int64) for a in args])
        return dict(zip(names, values))

    return run


def check_logdir_fits_model(config: TrainConfig) -> None:
    """Refuses, before any server starts, a logdir of another model."""
    latest = tf.train.latest_checkpoint(config.logdir)
    if not latest:
        return
    specs = params_lib.record(lambda: model_lib.build(
        config.model, tf.zeros([1, 28, 28, 1]), seed=config.seed,
        hidden_units=config.hidden_units))
    check_checkpoint_matches(latest, {s.name: list(s.shape) for s in specs},
                             config.model, exact=True)


def check_checkpoint_matches(path: str, expected: dict, model: str,
                             exact: bool = False) -> None:
    """Refuses a checkpoint whose entries do not fit this model."""
    found = tf.train.load_checkpoint(path).get_variable_to_shape_map()
    extra = sorted(name for name in found if name.startswith(
        params_lib.SCOPE + "/") and name.count("/") == 2
        and name not in expected)
    if exact and extra:
        raise UserError(
            f"checkpoint {path} does not fit --model={model}: it has "
            f"'{extra[0]}' {found[extra[0]]}, which this model does not; use "
            "a new --logdir, or the flags that wrote this checkpoint")
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
