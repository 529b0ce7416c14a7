"""What the chief and the other workers share: the graph they train on, its
session (connect, close) and the loop's callable; run.py drives them."""

import abc
import functools
import threading
import time

from absl import logging
import numpy as np

from trainer.cluster import ports
from trainer.cluster.spec import Task
from trainer.common.config import TrainConfig
from trainer.common.errors import RunFailed
from trainer.common.tf_session import make_callable
from trainer.learning.data import Mnist
from trainer.observe import tracing
from trainer.roles import (graph as worker_graph, sessions, standby, timing,
                           without_ps)
from trainer.roles.states import Machine

class WorkerRole(abc.ABC):
    """A worker's Python side; subclasses say what to do once connected.
    run.Roles.interrupt closes the session from a thread: it is under _lock."""

    def __init__(self, config: TrainConfig, task: Task, server,
                 mnist: Mnist, machine: Machine, as_chief: bool = False,
                 graph: worker_graph.WorkerGraph | None = None,
                 warmed: standby.Warmed | None = None):
        self.config, self.task, self.server = config, task, server
        self.mnist, self.machine = mnist, machine
        self.k = task.task_index
        self.train_steps = config.resolved_train_steps(len(mnist.train_labels))
        self.session, self._lock = None, threading.Lock()
        self.pushed = 0           # gradients this worker pushed, all sessions
        self.traces = []          # (first step, steps, RunMetadata)
        self.last_progress = time.monotonic()
        self.at_step = None   # our latest token's step (never the chief's)
        self.generation = None          # the chief's generation, once claimed
        # A session on g warmed for the first connect; later ones make theirs.
        self._warmed, self._warm_loop = warmed, None
        self.in_the_run = threading.Event()  # taken in, or taking over
        logging.info("%d global steps of %d images", self.train_steps,
                     config.batch_size)
        build = functools.partial(
            worker_graph.build_worker, config, task, len(mnist.train_labels),
            max(len(mnist.test_labels), 1), self.train_steps, as_chief)
        self.g = graph or build()
        self.graphs = standby.Graphs(
            task, config, build, lambda g, ps_down: standby.warm(
                config, task, server, g, without_ps.ps_tasks(task, ps_down)),
            ahead=as_chief)

    @abc.abstractmethod
    def run_connected(self) -> None:
        """Trains to the end with an open session (chief.py, worker.py)."""

    def with_step(self, reason: str) -> str:
        """`reason`, naming the step this worker was at (not the chief's)."""
        suffix = f"; this worker was at step {self.at_step}"
        if self.at_step is None or suffix in reason:
            return reason
        return reason + suffix

    def connect(self) -> None:
        """Opens the session, on the graph for the ps tasks the chief uses."""
        timeout = self.config.startup_timeout_secs
        down = self.take_back = None
        if self.config.ps_mirrors:
            wait_for_ps(self.task, timeout, only=[0])
            down, self.take_back = self.graphs.choose(
                self.server.target, self.g.chief is not None)
        if down != self.g.ps_down:   # a session warmed on g is of no use
            if self._warmed:
                sessions.close_within(self._warmed.session)
            self.g, self._warmed = self.graphs.switch(self.g, down)
        ps_tasks = without_ps.ps_tasks(self.task, down)
        wait_for_ps(self.task, timeout, only=ps_tasks)
        warmed = self._warm_loop = self._warmed
        self._warmed = None
        self.session = warmed.session if warmed else sessions.open_session(
            self.server.target, self.g.graph, self.config, self.task, ps_tasks)
        self.g.trainset.initialize(self.session, self.mnist.train_images,
                                   self.mnist.train_labels)
        if self.g.chief:
            self.g.chief.testset_init(self.session, self.mnist.test_images,
                                      self.mnist.test_labels)
        self.graphs.connected()

    def session_and_graph(self) -> tuple:
        """(the session or None, the WorkerGraph) at once (any thread)."""
        with self._lock:
            return self.session, self.g

    def close_session(self,
                      deadline: float = timing.CLOSE_DEADLINE_SECS) -> None:
        """Closes the session, going on without it after `deadline` s."""
        with self._lock:
            session, self.session = self.session, None
        if session is None or sessions.close_within(session, deadline):
            return
        logging.warning("the old session did not close within %.0f s (a "
                        "peer cut off or gone); going on without it", deadline)

    def callable(self, fetches: dict, feeds=()):
        return make_callable(self.session, fetches, feeds)

    def loop_callable(self):
        """(token int64 [4], count) -> outputs; split for --trace_steps."""
        feeds, bound = [self.g.start_token, self.g.num_steps], {}
        if self.g.chief:   # its loop writes only in its generation, claimed
            bound = {self.g.chief.generation: self.generation}
        warmed, self._warm_loop = self._warm_loop, None
        made = warmed.loop if warmed else self.callable(
            self.g.loop_outputs, [*feeds, *bound])

        def loop(token, count: int) -> dict:
            return made(token, count, *bound.values())
        if not (warmed or self.g.chief):
            # Placed by a run of 0 steps (it only reads) before we join.
            loop(token_of(0), 0)
        if self.config.trace_range() is None:
            return loop
        return tracing.split_loop(
            loop, tracing.traced_run(self.session, self.g.loop_outputs,
                                     feeds, bound),
            self.config.trace_range(), self.traces)


def token_of(step: int) -> np.ndarray:
    """The token (int64 [4]) of `step`, no round or slice: a loop's start."""
    return np.array([step, 0, 0, 0], np.int64)


def poll_until(ready, timeout: float, waiting, failure) -> None:
    """Polls ready() every timing.POLL_SECS until true, logging waiting(secs)
    every PROGRESS_LOG_SECS; past `timeout` s raises RunFailed(failure())."""
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
    """Waits until every ps task (or those in `only`) accepts connections."""
    pending = list(range(task.cluster.num_ps) if only is None else only)

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
