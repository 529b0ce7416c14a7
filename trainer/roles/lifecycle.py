"""What the chief and the other workers share: a session that survives the
loss of a ps task, fast callables, and ending a blocked run (from the
watchdog, trainer/roles/worker.py, or the chief's threads).

A worker that loses the ps tasks (one died or restarted) reconnects:
`WorkerRole.run` says how, step by step.
"""

import abc
import os
import threading
import time

from absl import logging
import numpy as np
import tensorflow as tf

from trainer.cluster import devices
from trainer.cluster import ports
from trainer.observe import tracing
from trainer.roles import without_ps
from trainer.roles import standby
from trainer.roles import takeover
from trainer.roles import timing
from trainer.roles.background import close_within
from trainer.roles import graph as worker_graph
from trainer.cluster.spec import Task
from trainer.common.config import TrainConfig
from trainer.learning.data import Mnist
from trainer.common.errors import RunFailed
from trainer.common.tf_session import error_summary, make_callable


class RunEnded(Exception):
    """The run ended (args[0]: its last step) while this worker was away."""


# Errors a task sees when a ps task died or restarted (connection refused,
# session or graph handle gone, variables gone or not yet initialized).
PS_LOST = (tf.errors.UnavailableError, tf.errors.AbortedError,
           tf.errors.NotFoundError, tf.errors.FailedPreconditionError,
           tf.errors.CancelledError, tf.errors.InternalError)


class WorkerRole(abc.ABC):
    """A worker's Python side; subclasses say what to do once connected.
    The watchdog thread may end a blocked session.run by closing the
    session (`give_up`); the reason it gives is read by the training
    thread when that run fails. Both go through `_lock`."""

    def __init__(self, config: TrainConfig, task: Task, server,
                 mnist: Mnist, as_chief: bool = False,
                 graph: worker_graph.WorkerGraph | None = None,
                 warmed: standby.Warmed | None = None):
        """graph: built beforehand (a spare chief's), or None to build;
        warmed: a session on it for the first connect, or None."""
        self.config, self.task, self.server = config, task, server
        self.mnist = mnist
        self.k = task.task_index
        self.train_steps = config.resolved_train_steps(
            len(mnist.train_labels))
        self.session = None
        self.pushed = 0           # gradients this worker pushed, all sessions
        self.traces = []          # (first step, steps, RunMetadata)
        self._stop_reason = None
        self._outage_secs = None   # set by the watchdog: join again
        self._reconnect_reason = None  # set by `reconnect`
        self._lock = threading.Lock()
        self.last_progress = time.monotonic()
        # The step of the latest token a worker other than the chief took
        # (None before its first, and on the chief), named when it fails.
        self.at_step = None
        self.generation = None          # the chief's generation, once claimed
        self._taking_over = None   # why this worker takes over the chief
        self._ended_at = None      # the last step, if the run ended unseen
        # A Warmed (session and loop made beforehand): the first connect
        # takes it; a later connect (a new session) makes its own loop.
        self._warmed = warmed
        self._warm_loop = None
        self.fixed = {}   # the fixed feeds of this session's callables
        self.in_the_run = threading.Event()  # taken in, or taking over
        logging.info("%d global steps of %d images", self.train_steps,
                     config.batch_size)
        sizes = (len(mnist.train_labels), max(len(mnist.test_labels), 1))
        self.g = graph or worker_graph.build_worker(
            config, task, *sizes, self.train_steps, as_chief)
        # With --ps_mirrors, the graphs without a ps (standby.py).
        self.graphs = standby.Graphs(
            task, config, lambda ps_down: worker_graph.build_worker(
                config, task, *sizes, self.train_steps, as_chief, ps_down),
            lambda g, ps_down: standby.warm(
                config, task, server, g, without_ps.ps_tasks(task, ps_down)),
            ahead=as_chief)

    @abc.abstractmethod
    def run_connected(self) -> None:
        """Trains to the end with an open session: the chief's and the
        other workers' own part (trainer/roles/chief.py,
        trainer/roles/worker.py)."""

    def run(self) -> None:
        """Connects and trains to the end, reconnecting after a lost ps:
        1. a session.run fails with one of PS_LOST (a ps died, restarted
           or is cut off); anything else, a failure after the watchdog
           closed the session, or no step succeeding for
           --startup_timeout_secs ends the task (`_check_reconnectable`);
        2. the broken session is closed; `_connect` waits until every ps
           accepts connections, opens a new session, loads the data;
        3. `run_connected` starts over: the chief restores the newest
           checkpoint, since a restarted ps lost the variables, and asks
           every worker to join again (chief.py `_initialize_or_restore`,
           coordination's start_op); another worker waits for the chief's
           handshake and joins (worker.py).
        """
        while True:
            try:
                try:
                    self._connect()
                    # Saver.save and .restore build nothing here, but look
                    # at the default graph to decide between graph and
                    # eager mode.
                    with self.g.graph.as_default():
                        self.run_connected()
                    return
                except RunFailed:
                    raise
                except Exception as e:  # noqa: BLE001 (re-raised below)
                    self._check_reconnectable(e)
            except RunFailed as e:
                raise RunFailed(self.with_step(str(e))) from None
            except RunEnded as e:
                logging.warning(
                    "the run ended at step %d, its last, while this "
                    "worker was away; nothing is left to do", e.args[0])
                return

    def with_step(self, reason: str) -> str:
        """`reason`, naming the step this worker was at (not the chief's)."""
        suffix = f"; this worker was at step {self.at_step}"
        if self.at_step is None or suffix in reason:
            return reason
        return reason + suffix

    def _connect(self) -> None:
        timeout = self.config.startup_timeout_secs
        down = self.take_back = None
        if self.config.ps_mirrors:
            wait_for_ps(self.task, timeout, only=[0])
            down, self.take_back = self.graphs.choose(
                self.server.target, self.g.chief is not None)
        if down != self.g.ps_down:   # a session warmed on g is of no use
            if self._warmed:
                close_within(self._warmed.session)
            self.g, self._warmed = self.graphs.switch(self.g, down)
        wait_for_ps(self.task, timeout,
                    only=without_ps.ps_tasks(self.task, down))
        warmed, self._warmed = self._warmed, None
        self._warm_loop = warmed
        # On the chief: its generation, set at its claim (_claim_and_start).
        self.fixed = warmed.loop.fixed if warmed else (
            {self.g.chief.generation: None} if self.g.chief else {})
        self.session = warmed.session if warmed else tf.compat.v1.Session(
            self.server.target, graph=self.g.graph,
            config=devices.session_config(
                self.config, self.task, without_ps.ps_tasks(self.task, down)))
        self.g.trainset.initialize(self.session, self.mnist.train_images,
                                   self.mnist.train_labels)
        if self.g.chief:
            self.g.chief.testset_init(self.session, self.mnist.test_images,
                                      self.mnist.test_labels)
        self.graphs.connected()

    def _check_reconnectable(self, error: Exception) -> None:
        """Re-raises `error` unless it is a lost ps worth reconnecting
        after; closes the broken session either way."""
        with self._lock:
            reason, outage = self._stop_reason, self._outage_secs
            again, self._reconnect_reason = self._reconnect_reason, None
            self._outage_secs = None
        if self._taking_over:  # the chief watch closed the session
            raise takeover.TakeOver(*self._taking_over) from None
        if self._ended_at is not None:  # so did it here
            raise RunEnded(self._ended_at) from None
        if reason:  # the watchdog closed the session
            raise RunFailed(reason) from None
        if outage is not None:  # closed by the watchdog: join again
            logging.warning(
                "worker %d: ps 0 answers again after %.0f s; joining again "
                "(the chief counted us out meanwhile)", self.k, outage)
            self.close_session()
            self.last_progress = time.monotonic()
            return
        if again or isinstance(error, without_ps.ServeAgain) or (
                without_ps.changed(error)):
            logging.warning("%s; connecting again",
                            again or error_summary(error))
            self.close_session(timing.QUICK_CLOSE_SECS)
            return
        if not isinstance(error, PS_LOST):
            raise error
        # The run failed: nothing of it is left to cancel, and the close's
        # clean-up may wait on a ps that is gone.
        self.close_session(timing.QUICK_CLOSE_SECS)
        first_line = error_summary(error)
        if time.monotonic() - self.last_progress > (
                self.config.startup_timeout_secs):
            raise RunFailed(
                f"no training step succeeded for "
                f"{self.config.startup_timeout_secs:.0f} s "
                f"(--startup_timeout_secs); last error: {first_line}"
                ) from None
        logging.warning("lost the ps tasks (%s); reconnecting", first_line)

    def close_session(self,
                      deadline: float = timing.CLOSE_DEADLINE_SECS) -> None:
        """Closes the session, waiting at most `deadline` (close_within);
        past it, this worker goes on without that session."""
        with self._lock:
            session, self.session = self.session, None
        if session is not None and not close_within(session, deadline):
            logging.warning("the old session did not close within %.0f s "
                            "(a peer cut off or gone); going on without it",
                            deadline)

    def callable(self, fetches: dict, feeds=(), fixed=None):
        return make_callable(self.session, fetches, feeds, fixed)

    def loop_callable(self):
        """(start token int64 [4], count) -> the loop's outputs. With
        --trace_steps=A:B, runs of steps that cross [A, B) are split so
        that each step in it runs alone, traced (trainer/observe/tracing.py).
        """
        feeds = [self.g.start_token, self.g.num_steps]
        warmed, self._warm_loop = self._warm_loop, None
        fixed = self.fixed   # the chief's loop writes only in its generation
        if warmed:   # made and placed beforehand on this session
            loop = warmed.loop
        else:
            loop = self.callable(self.g.loop_outputs, feeds, fixed)
            if not self.g.chief:
                # Its first run (0 steps: it only reads) before we join,
                # so that our first round waits for nothing more.
                loop(token_of(0), 0)
        if self.config.trace_range() is None:
            return loop
        return tracing.split_loop(
            loop, tracing.traced_run(self.session, self.g.loop_outputs,
                                     feeds, fixed),
            self.config.trace_range(), self.traces)

    def join_again(self, outage_secs: float) -> None:
        """From the watchdog: ps 0 answers again after `outage_secs`, long
        enough for the chief to have counted this worker out. Its blocked
        run may wait forever on a token or a reply lost with the link, so
        it is ended; run() then reconnects and joins as a restarted
        worker does."""
        with self._lock:
            self._outage_secs = outage_secs
        self.close_session()

    def reconnect(self, reason: str) -> None:
        """Ends the blocked run: run() then connects again (the chief, on
        a ps gone down: without_ps.py)."""
        with self._lock:
            self._reconnect_reason = reason
        self.close_session()

    def take_over(self, reason: str) -> None:
        """From the chief watch: claim the chief's role, then end the
        blocked run; run() then raises TakeOver, and this process starts
        the chief's side."""
        claim = takeover.Claim(self.server.target, self.task, self.config,
                               self.k, self.g.ps_down)
        with self._lock:
            self._taking_over = (reason, claim)
        self.close_session()

    def run_ended(self, step: int) -> None:
        """From the chief watch: the run ended at `step`, the last, while
        this worker was away; end the blocked run, and run() returns."""
        with self._lock:
            self._ended_at = step
        self.close_session()

    def give_up(self, reason: str) -> None:
        """From the watchdog: end the blocked session.run with a reason."""
        logging.info("the watchdog ends the blocked training run")
        reason = self.with_step(reason)
        with self._lock:
            self._stop_reason = reason
        # Closing the session normally cancels the run the training thread
        # is blocked in, and that thread raises `reason`. With ps 0 cut off,
        # the close or the cancelled run can block as long as TCP retries
        # the silent peer; then leaving is the only way to end the process.
        threading.Thread(target=self._exit_if_still_running, args=(reason,),
                         daemon=True, name="give-up-deadline").start()
        self.close_session()

    @staticmethod
    def _exit_if_still_running(reason: str) -> None:
        time.sleep(timing.CLOSE_DEADLINE_SECS)
        logging.error("%s; the blocked session did not end within %.0f s; "
                      "exiting", reason, timing.CLOSE_DEADLINE_SECS)
        logging.flush()
        os._exit(1)


def token_of(step: int) -> np.ndarray:
    """The token of `step` with no round or slice (int64 [4]): what the
    chief's loop starts from."""
    return np.array([step, 0, 0, 0], np.int64)


def poll_until(ready, timeout: float, waiting, failure) -> None:
    """Calls ready() every timing.POLL_SECS until it returns true. Every
    timing.PROGRESS_LOG_SECS logs waiting(seconds so far) (a line); after
    `timeout` seconds raises RunFailed(failure())."""
    start = time.monotonic()
    next_log = start + timing.PROGRESS_LOG_SECS
    while not ready():
        now = time.monotonic()
        if now - start > timeout:
            raise RunFailed(failure())
        if now >= next_log:
            logging.info("%s", waiting(now - start))
            next_log = now + timing.PROGRESS_LOG_SECS
        time.sleep(timing.POLL_SECS)


def wait_for_ps(task: Task, timeout: float,
                only: list[int] | None = None) -> None:
    """Waits until every ps task (or those in `only`) accepts
    connections, logging progress."""
    pending = list(range(task.cluster.num_ps)) if only is None else only

    def ready() -> bool:
        pending[:] = [i for i in pending if ports.answer(
            task.cluster.ps[i], 1.0, "--ps_hosts") != ports.OPEN]
        return not pending

    def names() -> str:
        return ", ".join(task.cluster.describe("ps", i) for i in pending)

    poll_until(ready, timeout,
               lambda secs: f"waiting for {names()} to start: {secs:.0f} s",
               lambda: f"{names()} did not start within {timeout:.0f} s "
                       "(--startup_timeout_secs); start it (run_ps.sh) or "
                       "fix --ps_hosts")
